"""--init-from (snapshots/init_from.py): each format gives a fresh run's first step its weights,
under ddp and fsdp; strict by default (one line, exit 2), --init-from-partial names the rest."""

import json
import sys

import pytest
import torch

from ddptrain import RunConfig
from ddptrain.tasks import build
from helpers.commands import REPO, assert_same_weights, ddptrain_cli, fit, load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("init") / "source"
    fit("regression", run_dir, max_epochs=1, save_every=10, keep=5)
    return run_dir


def _started_from(tmp_path, name, path, **options):
    """model.pt of a run of no steps (--max-epochs 0): the weights the first step would start from."""
    fit("regression", tmp_path / name, max_epochs=0, init_from=str(path), **options)
    return load_model(tmp_path / name)


def test_each_format_gives_the_first_step_its_weights(source, tmp_path):
    from safetensors.torch import save_file

    trained = load_model(source)
    exported = ddptrain_cli("export", str(source), "--format", "safetensors", "--out", str(tmp_path / "m.safetensors"))
    assert exported.returncode == 0, exported.stderr
    hf, sharded = tmp_path / "hf", tmp_path / "hf-sharded"
    hf.mkdir(), sharded.mkdir()
    save_file(trained, hf / "model.safetensors")  # a Hugging Face folder's layout
    for i, key in enumerate(sorted(trained)):  # and a sharded one, with its index
        save_file({key: trained[key]}, sharded / f"model-{i}.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {key: f"model-{i}.safetensors" for i, key in enumerate(sorted(trained))}}))
    formats = {"model-pt": source / "model.pt", "run-dir": source, "safetensors": tmp_path / "m.safetensors",
               "hf": hf, "hf-sharded": sharded}
    for name, path in formats.items():
        assert_same_weights(_started_from(tmp_path, name, path), trained, exact=True)
    snapshot = source / "snapshots" / "step-000000010.pt"
    saved = torch.load(snapshot, weights_only=True)["model"]
    assert_same_weights(_started_from(tmp_path, "snapshot", snapshot), saved, exact=True)
    assert not torch.equal(saved["weight"], trained["weight"])  # (another point of the run than model.pt)
    assert_same_weights(_started_from(tmp_path, "fsdp", source / "model.pt", strategy="fsdp"), trained, exact=True)


def test_other_weights_are_one_line_unless_partial(source, tmp_path, capfd):
    trained = load_model(source)
    torch.save({"encoder.weight": torch.zeros(3)}, tmp_path / "other.pt")
    refused = ddptrain_cli("train", "--task", "regression", "--max-epochs", "0", "--run-dir", str(tmp_path / "r"),
                           "--init-from", str(tmp_path / "other.pt"))
    assert refused.returncode == 2
    assert refused.stderr.strip() == (f"ddptrain: error: --init-from {tmp_path / 'other.pt'}: not this model's "
                                      "weights (2 missing, e.g. ['bias', 'weight']; 1 unexpected, e.g. "
                                      "['encoder.weight']); add --init-from-partial to load the tensors that match")
    torch.save({"weight": torch.zeros(1, 5)}, tmp_path / "shape.pt")
    shape = ddptrain_cli("train", "--task", "regression", "--max-epochs", "0", "--run-dir", str(tmp_path / "s"),
                         "--init-from", str(tmp_path / "shape.pt"), "--init-from-partial")
    assert shape.returncode == 2 and "weight has shape (1, 5) there, (1, 20) in the model" in shape.stderr

    torch.save({"weight": trained["weight"], "extra": torch.ones(2)}, tmp_path / "part.pt")
    started = _started_from(tmp_path, "partial", tmp_path / "part.pt", init_from_partial=True)
    assert torch.equal(started["weight"], trained["weight"]) and not torch.equal(started["bias"], trained["bias"])
    out = capfd.readouterr().out
    assert f"initialised from {tmp_path / 'part.pt'}: 1 tensor(s); left as built: ['bias']; ignored: ['extra']" in out


def test_a_transformers_save_pretrained_folder_starts_the_examples_gpt2(tmp_path):
    """A real Hugging Face folder (save_pretrained: safetensors, config.json, GPT-2's lm_head
    tied to its embedding and so not saved twice), strict: every tensor of the model arrives."""
    pytest.importorskip("transformers", reason="the hf extra (pip install 'ddptrain[hf]') is not installed")
    sys.path.insert(0, str(REPO / "examples"))  # the ranks, forked from here, import the example too
    import hf_causal_lm

    pretrained = build(RunConfig(task="hf", seed=7), hf_causal_lm.gpt2_task).model
    pretrained.save_pretrained(tmp_path / "gpt2")
    fit("hf_causal_lm:gpt2_task", tmp_path / "tuned", max_epochs=0, init_from=str(tmp_path / "gpt2"))
    started = load_model(tmp_path / "tuned")
    assert_same_weights(started, pretrained.state_dict(), exact=True)
