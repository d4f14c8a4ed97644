"""--tp 2 with --strategy fsdp on 4 CPU ranks (a 2 x 2 mesh over gloo): the job DDP trains on 2
ranks at the same global batch, killed and resumed bitwise, resumed under another layout; with
--ema and --keep-best in every run (the average split as the weights are; the best kept whole)
and activation checkpointing in the TP ones (each block's forward run again in its backward, on
its share of the heads).

One set of runs serves every test (module fixture): DDP on 2 ranks, TP x FSDP on 4, and a TP run
killed past step 10 whose snapshot there is resumed under the same layout, under fsdp on 2 and on 4
ranks; then fsdp's snapshot resumed under TP again; a TP run started from DDP's model.pt
(--init-from); TP under hsdp (2 replica groups). And a Hugging Face Llama split by its own plan,
its loss a (sum, count) of the tokens it predicts, beside DDP."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ddptrain.errors import ConfigError, TrainingFailed
from helpers.commands import assert_ok, assert_same_weights, ddptrain_cli, fit, load_model, read_metrics

pytestmark = pytest.mark.slow

TASK = "tp_tasks:blocks"
SAMPLES = {"BLOCK_SAMPLES": "297"}  # 10 steps an epoch at 32 a step, the last of 9
COMMON = {"batch_size": 8, "grad_accum": 2, "max_epochs": 2, "clip_grad": 0.5, "save_every": 5, "ema": 0.9,
          "keep_best": "eval_loss"}
TP = {"nproc": 4, "strategy": "fsdp", "tp": 2, "activation_checkpointing": True}
LLAMA = {"batch_size": 8, "max_epochs": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp")
    fit(TASK, base / "ddp", env=SAMPLES, nproc=2, **COMMON)
    fit(TASK, base / "tp", env=SAMPLES, **TP, **COMMON)
    # rank 3's 36th loss (2 micro-batches a step, and epoch 0's evaluation batches: the weights' and
    # the average's): near step 13, once step 10's snapshot is committed
    kill = {**SAMPLES, "KILL_RANK": "3", "KILL_STEP": "36", "KILL_MARKER": str(base / "killed"),
            "KILL_ONCE_SAVED": str(base / "killed-run" / "snapshots")}
    with pytest.raises(TrainingFailed):
        fit("tp_tasks:killable_blocks", base / "killed-run", env=kill, **TP, **COMMON)
    for layout in ("other-layout", "four-ranks"):
        shutil.copytree(base / "killed-run", base / layout)
    fit("tp_tasks:killable_blocks", base / "killed-run", env=kill, **TP, **COMMON)  # (killed once: the marker)
    fit("tp_tasks:killable_blocks", base / "other-layout", env=SAMPLES, nproc=2, strategy="fsdp", **COMMON)
    fit("tp_tasks:killable_blocks", base / "four-ranks", env=SAMPLES, nproc=4, strategy="fsdp", **COMMON)
    # and back: fsdp's step-15 snapshot (of the run above on 2 ranks) resumed under --tp 2
    shutil.copytree(base / "other-layout", base / "back-to-tp", ignore=shutil.ignore_patterns("step-000000020*"))
    (base / "back-to-tp" / "model.pt").unlink()
    fit("tp_tasks:killable_blocks", base / "back-to-tp", env=SAMPLES, **TP, **COMMON)
    fit(TASK, base / "init-from", env=SAMPLES, **TP, init_from=str(base / "ddp" / "model.pt"), eval_at_start=True,
        batch_size=8, grad_accum=2, max_steps=1)
    fit(TASK, base / "hsdp-tp", env=SAMPLES, **{**TP, "strategy": "hsdp", "replicas": 2}, **COMMON)
    fit("tp_tasks:llama", base / "llama-ddp", nproc=2, **LLAMA)
    fit("tp_tasks:llama", base / "llama-tp", **TP, **LLAMA)
    return base


def _epochs(run_dir):
    return [r for r in read_metrics(run_dir) if r.get("kind") == "epoch"]


def test_tp_with_fsdp_trains_what_ddp_trains_on_the_same_global_batch(runs):
    """The same weights (to the reduction order's rounding), the same average (ema/model.pt),
    epoch records and evaluations (the average's too); model.pt holds whole tensors."""
    tp, ddp = load_model(runs / "tp"), load_model(runs / "ddp")
    assert {k: v.shape for k, v in tp.items()} == {k: v.shape for k, v in ddp.items()}
    assert_same_weights(tp, ddp)
    assert_same_weights(load_model(runs / "tp" / "ema"), load_model(runs / "ddp" / "ema"))
    assert any(not torch.equal(a, b) for a, b in zip(load_model(runs / "tp" / "ema").values(), tp.values()))
    for mine, theirs in zip(_epochs(runs / "tp"), _epochs(runs / "ddp"), strict=True):
        assert (mine["step"], mine["samples"], mine["eval_samples"]) == (theirs["step"], 297, 75)
        for figure in ("train_loss", "grad_norm", "eval_loss", "ema_eval_loss"):
            assert mine[figure] == pytest.approx(theirs[figure], rel=1e-6), figure
    assert [r["step"] for r in _epochs(runs / "tp")] == [10, 20]  # 297 samples / 32 a step: 10 (the last 9)


def test_hsdp_with_tp_trains_what_ddp_trains(runs):
    """--strategy hsdp --replicas 2 --tp 2 on 4 ranks (a 3-D mesh: 2 replica groups of 1 sharding
    rank, each a tensor-parallel group of 2): DDP's weights, average and epochs to the same
    rounding as fsdp's; model.pt whole."""
    hsdp, ddp = load_model(runs / "hsdp-tp"), load_model(runs / "ddp")
    assert {k: v.shape for k, v in hsdp.items()} == {k: v.shape for k, v in ddp.items()}
    assert_same_weights(hsdp, ddp)
    assert_same_weights(load_model(runs / "hsdp-tp" / "ema"), load_model(runs / "ddp" / "ema"))
    for mine, theirs in zip(_epochs(runs / "hsdp-tp"), _epochs(runs / "ddp"), strict=True):
        assert (mine["step"], mine["samples"]) == (theirs["step"], 297)
        for figure in ("train_loss", "grad_norm", "eval_loss"):
            assert mine[figure] == pytest.approx(theirs[figure], rel=1e-6), figure


def test_tp_keeps_the_best_model_whole_as_ddp_does(runs):
    """--keep-best eval_loss: the same evaluation kept (its step), its weights whole and within the
    reduction order's rounding of DDP's kept best."""
    best = {run: json.loads((runs / run / "best" / "best.json").read_text()) for run in ("tp", "ddp")}
    assert best["tp"]["step"] == best["ddp"]["step"] and best["tp"]["value"] == pytest.approx(best["ddp"]["value"],
                                                                                              rel=1e-6), best
    assert_same_weights(load_model(runs / "tp" / "best"), load_model(runs / "ddp" / "best"))


def test_a_tp_run_starts_from_a_ddp_model_file(runs):
    """--init-from DDP's model.pt (whole tensors) into the 2 x 2 layout: its evaluation before step 1
    is DDP's last, to the reduction order's rounding (each rank took its share of each split layer)."""
    (start,) = [r for r in read_metrics(runs / "init-from") if r.get("kind") == "eval" and r["step"] == 0]
    assert start["eval_loss"] == pytest.approx(_epochs(runs / "ddp")[-1]["eval_loss"], rel=1e-6)
    assert (runs / "init-from" / "model.pt").exists()


def test_a_tp_run_killed_and_resumed_ends_bitwise_as_the_uninterrupted_one(runs):
    assert (runs / "killed").exists(), "rank 3 was never killed"
    assert_same_weights(load_model(runs / "killed-run"), load_model(runs / "tp"), exact=True)
    assert_same_weights(load_model(runs / "killed-run" / "ema"), load_model(runs / "tp" / "ema"), exact=True)
    assert [r["step"] for r in _epochs(runs / "killed-run")] == [10, 20]


def test_a_hugging_face_llama_splits_by_its_own_plan_and_trains_what_ddp_trains(runs):
    """No Task.tp_plan: the Llama's tp_plan splits its embedding by vocabulary, q, k, v (4 heads, 2
    of keys and values: 2 and 1 a rank) and its MLP, and gathers the LM head's logits; the head's
    weight is the embedding's (tied), split once and trained as one (torch's parallelize_module
    gives each layer its own: tensor_parallel.retie). Its loss is a
    (sum, count) over the tokens it predicts (token 0 is never a target: each step a mean over a
    different count), which a group's ranks count once. 26 AdamW steps on 200 sequences (a partial
    last step) end within 1e-5 of DDP's weights (measured: 1.4e-6 on weights of about 0.09; fsdp on
    2 ranks equals DDP bitwise, so the gap is TP's sums' order)."""
    tp, ddp = load_model(runs / "llama-tp"), load_model(runs / "llama-ddp")
    assert {k: v.shape for k, v in tp.items()} == {k: v.shape for k, v in ddp.items()}
    assert torch.equal(tp["lm_head.weight"], tp["model.embed_tokens.weight"])  # still tied
    for name, weight in ddp.items():
        torch.testing.assert_close(tp[name], weight, rtol=0, atol=1e-5, msg=name)
    for mine, theirs in zip(_epochs(runs / "llama-tp"), _epochs(runs / "llama-ddp"), strict=True):
        assert (mine["step"], mine["samples"]) == (theirs["step"], 200)
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-6)
    assert [r["step"] for r in _epochs(runs / "llama-tp")] == [13, 26]


def test_a_tp_run_exports_as_a_hugging_face_folder_and_safetensors(runs, tmp_path):
    """export reads model.pt (whole tensors): the Llama trained under --tp as an HF folder that
    transformers loads, tied as it was, and as safetensors, each equal to model.pt."""
    import transformers
    from safetensors.torch import load_file

    assert_ok(ddptrain_cli("export", str(runs / "llama-tp"), "--format", "hf", "--out", str(tmp_path / "hf")))
    assert_ok(ddptrain_cli("export", str(runs / "llama-tp"), "--format", "safetensors",
                           "--out", str(tmp_path / "model.safetensors")))
    trained = load_model(runs / "llama-tp")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert_same_weights(loaded.state_dict(), trained, exact=True)
    assert_same_weights(load_file(tmp_path / "model.safetensors"), trained, exact=True)  # (tied: a copy a name)


@pytest.mark.parametrize("layout", ["other-layout", "four-ranks", "back-to-tp"])
def test_a_snapshot_resumes_under_another_layout(runs, layout):
    """DCP reshards the snapshot: 2 x 2 (step 10) onto fsdp's 2 ranks (the same data-parallel world)
    and onto 4 (the batch per rank halved to keep the global batch), and fsdp's 2 ranks (step 15)
    back onto 2 x 2. Each ends where DDP ends, every epoch's samples once."""
    assert_same_weights(load_model(runs / layout), load_model(runs / "ddp"))
    assert_same_weights(load_model(runs / layout / "ema"), load_model(runs / "ddp" / "ema"))
    assert [(r["step"], r["samples"]) for r in _epochs(runs / layout)] == [(10, 297), (20, 297)]


def test_a_world_tp_does_not_divide_and_a_task_without_a_plan_are_one_line_each(tmp_path):
    with pytest.raises(ConfigError, match=r"^--tp 2 does not divide the world of 3 ranks into groups; use a --tp "):
        fit(TASK, tmp_path / "three", nproc=3, strategy="fsdp", tp=2, max_steps=1)
    with pytest.raises(ConfigError, match=r"^--tp 2: the task names no layers to split \(Task.tp_plan: "):
        fit("block_tasks:blocks", tmp_path / "planless", nproc=2, strategy="fsdp", tp=2, max_steps=1)
