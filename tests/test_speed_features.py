"""The speed features do what they say: each test would fail with the feature switched off."""

import importlib.util
import json

import pytest

from conftest import BIN, assert_ok, assert_same_weights, fit, load_model, read_metrics, run

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
def test_compile_trains_a_compiled_module_to_allclose_weights_and_plain_keys(plain, tmp_path):
    settings = tmp_path / "settings.json"
    fit(TASKS + "ddp_settings", tmp_path / "run", env={"SETTINGS_FILE": str(settings)}, compile=True, **EPOCHS)
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


def _table(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("job "))
    for column in ("samples/s (min-max)", "vs loop", "1-epoch wall (min-max)", "vs fastest peer", "final loss"):
        assert column in lines[header]
    return [line.split() for line in lines[header + 2:] if line.startswith("tutorial ")]


@pytest.mark.slow
def test_bench_with_peers_prints_one_table_of_the_same_job(tmp_path):
    """The benchmark's plumbing (its figures are not asserted: a smoke run measures nothing)."""
    if not all(importlib.util.find_spec(peer) for peer in ("lightning", "accelerate")):  # (importing Lightning
        pytest.skip("the bench extra (pip install 'ddptrain[bench]') is not installed")  # here sets variables)
    result = run([str(BIN / "ddptrain"), "bench", "--smoke", "--peers", "--reps", "1", "--jobs", "tutorial",
                  "--contenders", "loop,ddptrain,lightning,accelerate", "--out", str(tmp_path)], timeout=300)
    assert_ok(result)
    rows = _table(result.stdout)
    assert [r[1] for r in rows] == ["loop", "ddptrain", "lightning", "accelerate"]
    assert "tutorial: every contender ended at the same loss: yes" in result.stdout
    saved = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(saved) == 4 and all(r["wall_1_epoch_s"] > 0 and r["same_loss_as_all"] for r in saved)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_bench_names_missing_peers_in_one_line(tmp_path):
    hide = "import sys; sys.modules['lightning'] = sys.modules['accelerate'] = None; from ddptrain.cli import main; "
    result = run([str(BIN / "python"), "-c", hide + "sys.exit(main(sys.argv[1:]))", "bench", "--smoke", "--peers",
                  "--reps", "1", "--jobs", "tutorial", "--contenders", "ddptrain-skip", "--out", str(tmp_path)],
                 timeout=300)
    assert_ok(result)
    missing = [line for line in result.stdout.splitlines() if "not installed" in line]
    assert missing == ["ddptrain bench: lightning and accelerate not installed (pip install 'ddptrain[bench]'): "
                       "their rows are left out"]
    assert [r[1] for r in _table(result.stdout)] == ["ddptrain-skip"]
