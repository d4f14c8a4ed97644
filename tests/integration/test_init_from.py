"""--init-from (snapshots/init_from.py): each format gives a fresh run's first step its weights,
under ddp and fsdp; strict by default (one line, exit 2), --init-from-partial names the rest."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from ddptrain import ConfigError, RunConfig
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
    torch.save({"weight": torch.zeros(1, 5), "bias": trained["bias"]}, tmp_path / "shape.pt")  # another head
    shape = ddptrain_cli("train", "--task", "regression", "--max-epochs", "0", "--run-dir", str(tmp_path / "s"),
                         "--init-from", str(tmp_path / "shape.pt"))
    assert shape.returncode == 2 and len(shape.stderr.strip().splitlines()) == 1, shape.stderr
    assert "weight has shape (1, 5) there, (1, 20) in the model" in shape.stderr
    assert "--init-from-partial" in shape.stderr
    capfd.readouterr()
    started = _started_from(tmp_path, "reshaped", tmp_path / "shape.pt", init_from_partial=True)  # the head as built
    assert torch.equal(started["bias"], trained["bias"]) and not torch.equal(started["weight"], torch.zeros(1, 20))
    assert (f"initialised from {tmp_path / 'shape.pt'}: 1 tensor(s); left as built: ['weight']; ignored: []; "
            "of another shape: weight (1, 5) there, (1, 20) here") in capfd.readouterr().out

    torch.save({"weight": trained["weight"], "extra": torch.ones(2)}, tmp_path / "part.pt")
    started = _started_from(tmp_path, "partial", tmp_path / "part.pt", init_from_partial=True)
    assert torch.equal(started["weight"], trained["weight"]) and not torch.equal(started["bias"], trained["bias"])
    out = capfd.readouterr().out
    assert f"initialised from {tmp_path / 'part.pt'}: 1 tensor(s); left as built: ['bias']; ignored: ['extra']" in out



def test_an_unreadable_weights_file_is_named_with_what_is_wrong_with_it(source, tmp_path):
    """Not torch's advice about _use_new_zipfile_serialization cut mid-sentence: the file and its fault.
    Given with --resume never on a finished run, the error comes before its files are moved aside."""
    import shutil

    from ddptrain.snapshots.init_from import read_weights

    (tmp_path / "empty.pt").write_bytes(b"")
    finished = tmp_path / "finished"
    shutil.copytree(source, finished)
    bad = ddptrain_cli("train", "--task", "regression", "--max-epochs", "1", "--run-dir", str(finished),
                       "--resume", "never", "--init-from", str(tmp_path / "empty.pt"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert f"{tmp_path / 'empty.pt'} is empty (0 bytes)" in bad.stderr and "_use_new_zipfile" not in bad.stderr
    assert sorted(p.name for p in finished.iterdir()) == sorted(p.name for p in source.iterdir())  # nothing moved
    for name, content, words in [("cut.pt", (source / "model.pt").read_bytes()[:300], "is damaged (300 bytes; "),
                                 ("notes.pt", b"hello", "is neither a torch.save file nor safetensors"),
                                 ("cut.safetensors", b"hello", "is not a readable safetensors file (5 bytes")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / name} {words}")):
            read_weights(str(tmp_path / name))


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


def _anon_mb() -> float:
    """This process's anonymous resident memory (RssAnon: what a full copy of the weights would
    take; the pages of a memory-mapped file are RssFile, which the kernel can drop)."""
    import re

    status = Path("/proc/self/status").read_text()
    return int(re.search(r"RssAnon:\s+(\d+)", status).group(1)) / 1024


def _peak_anon_growth_mb(work) -> float:
    """The most RssAnon grew above its starting value while ``work()`` ran (sampled every ms)."""
    import threading
    import time

    start, peak, done = _anon_mb(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anon_mb() - start)
            time.sleep(0.001)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _anon_mb() - start)


def _fsdp_load_growth(rank, world, path, materialised):
    from torch.distributed.fsdp import fully_shard

    from ddptrain.snapshots.init_from import load_into, read_weights

    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048, bias=False) for _ in range(8)))  # 128 MB
    for layer in model:
        fully_shard(layer)
    fully_shard(model)

    def load() -> None:
        weights = torch.load(path, weights_only=True) if materialised else read_weights(str(path))
        load_into(model, weights, str(path), partial=False)
    growth = _peak_anon_growth_mb(load)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # (after the measurement)
    return growth, torch.equal(full["3.weight"], torch.load(path, weights_only=True)["3.weight"])


def test_under_fsdp_a_rank_never_holds_a_whole_copy_of_the_weights_it_starts_from(tmp_path):
    """Each rank of 2 keeps its half of a 128 MB model; --init-from reads the file memory-mapped
    and each rank copies out its shard: its anonymous memory grows by about its shard's size
    (56 MB of 64 measured), never by the whole model. The same measurement sees a whole copy
    where there is one (the control: the file read into memory first)."""
    from helpers.ranks import run_on_ranks

    path = tmp_path / "model.pt"
    torch.manual_seed(0)
    torch.save({f"{i}.weight": torch.randn(2048, 2048) for i in range(8)}, path)
    mapped = run_on_ranks(2, _fsdp_load_growth, path, False)
    whole = run_on_ranks(2, _fsdp_load_growth, path, True)
    assert all(loaded for _, loaded in mapped + whole)
    # at most about the rank's shard (64 MB)
    assert all(growth < 96 for growth, _ in mapped), mapped
    assert all(growth > 128 for growth, _ in whole), whole
