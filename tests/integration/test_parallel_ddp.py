"""DDP's speed features (comm hooks, static graph, bucket size, compile, clipping) do what they
say: each test would fail with the feature switched off; unused parameters are named."""

import json

import pytest

from helpers.commands import assert_same_weights, fit, load_model, read_metrics

TASKS = "ddptrain_test_tasks:"
EPOCHS = {"max_epochs": 2}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """digits and the tutorial's regression with DDP's own all-reduce, the reference."""
    base = tmp_path_factory.mktemp("plain")
    fit("digits", base / "digits", **EPOCHS)
    fit("regression", base / "regression", **EPOCHS)
    return base


def _relative_difference(a, b) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


@pytest.mark.slow
def test_powersgd_compresses_gradients_and_still_trains(plain, tmp_path):
    """digits' 128x128 layers are big enough for rank-1 PowerSGD to compress (Linear(20, 1) is
    not: PowerSGD sends such tensors uncompressed)."""
    fit("digits", tmp_path, comm_hook="powersgd", **EPOCHS)
    difference = _relative_difference(load_model(tmp_path), load_model(plain / "digits"))
    assert 0.01 < difference < 0.3, difference  # another gradient than the all-reduce's, a close one
    accuracy = read_metrics(tmp_path)[-1]["eval_accuracy"]
    assert accuracy > read_metrics(plain / "digits")[-1]["eval_accuracy"] - 0.06


@pytest.mark.slow
def test_fp16_hook_rounds_the_communicated_gradients(plain, tmp_path):
    fit("regression", tmp_path, comm_hook="fp16", **EPOCHS)
    difference = _relative_difference(load_model(tmp_path), load_model(plain / "regression"))
    assert 0 < difference < 1e-2, difference


@pytest.mark.slow
def test_clip_grad_bounds_the_gradient_norm(tmp_path):
    norms = {}
    for clip in (None, 0.5):
        record = tmp_path / f"norms-{clip}"
        fit(TASKS + "grad_norms", tmp_path / str(clip), env={"GRAD_NORMS_FILE": str(record)}, clip_grad=clip, **EPOCHS)
        norms[clip] = [float(line) for line in record.read_text().split()]
    assert max(norms[None]) > 2.0  # without clipping the norm goes well past the bound
    assert max(norms[0.5]) <= 0.5 * (1 + 1e-5) and len(norms[0.5]) == 2 * 2 * 32  # every step, both ranks


@pytest.mark.slow
def test_static_graph_and_bucket_size_reach_ddp_and_keep_the_weights_bitwise(plain, tmp_path):
    import json

    settings = tmp_path / "settings.json"
    fit(TASKS + "ddp_settings", tmp_path / "run", env={"SETTINGS_FILE": str(settings)}, static_graph=True,
        bucket_cap_mb=1, **EPOCHS)
    assert json.loads(settings.read_text()) == {"wrapper": "DistributedDataParallel", "static_graph": True,
                                                "bucket_bytes_cap": 2**20, "compiled": False}
    assert_same_weights(load_model(tmp_path / "run"), load_model(plain / "regression"), exact=True)


@pytest.mark.slow
def test_compile_trains_a_compiled_module_to_allclose_weights_and_plain_keys(plain, tmp_path, capfd):
    settings = tmp_path / "settings.json"
    fit(TASKS + "ddp_settings", tmp_path / "run", env={"SETTINGS_FILE": str(settings)}, compile=True, **EPOCHS)
    assert "global hooks" not in capfd.readouterr().err  # torch's warning of the FLOP counter's step
    assert json.loads(settings.read_text())["compiled"]  # DDP wraps torch.compile's module
    compiled = load_model(tmp_path / "run")
    assert set(compiled) == {"weight", "bias"}  # no "_orig_mod." prefixes
    assert_same_weights(compiled, load_model(plain / "regression"))


@pytest.mark.slow
def test_unused_parameters_error_names_the_flag_and_the_flag_works(tmp_path):
    from ddptrain import ConfigError

    with pytest.raises(ConfigError, match="unused.weight, unused.bias got no gradient .* --find-unused-parameters"):
        fit(TASKS + "unused_parameters", tmp_path / "a", max_epochs=1)
    fit(TASKS + "unused_parameters", tmp_path / "b", max_epochs=1, find_unused_parameters=True)
