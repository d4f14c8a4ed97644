"""Task factories the tests pass as ``--task ddptrain_test_tasks:FUNC`` (or to ``fit``).

They run inside real ranks; tests steer them with environment variables (inherited by every
rank). None of them replaces a part of torch.distributed: they only fail, hang, record or kill.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import Subset, TensorDataset

from ddptrain import Task
from ddptrain.tasks import digits_task, regression_task

from kills import _first_attempt, _on_step, _rank, killable, killed_on_schedule

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))


def fail_on_rank(cfg) -> Task:
    """Rank FAIL_RANK raises at step FAIL_STEP."""
    rank, step = int(os.environ["FAIL_RANK"]), int(os.environ["FAIL_STEP"])

    def maybe_fail(n: int) -> None:
        if n == step and _rank() == rank:
            raise RuntimeError(f"deliberate failure on rank {rank} at step {step}")
    return _on_step(regression_task(cfg), maybe_fail)


kill_at_step = killable(regression_task)


def kill_while_snapshotting(cfg) -> Task:
    """On the first attempt, rank 0 dies half-way through writing its KILL_SNAPSHOT-th snapshot
    file: half the bytes are in the temporary file when SIGKILL arrives."""
    import io

    import ddptrain.snapshots.files as files

    target, marker = int(os.environ["KILL_SNAPSHOT"]), Path(os.environ["KILL_MARKER"])
    real_save, calls = files.atomic_save, {"n": 0}

    def dying_save(obj, path):
        if path.name.startswith("step-"):
            calls["n"] += 1
        if calls["n"] == target and _first_attempt(marker):
            marker.write_text("killed")
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            with open(path.with_name(f".{path.name}.{os.getpid()}.tmp"), "wb") as handle:
                handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                handle.flush()
                os.fsync(handle.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        real_save(obj, path)

    files.atomic_save = dying_save
    return regression_task(cfg)


def kill_during_async_save(cfg) -> Task:
    """digits under fsdp; on the first attempt rank 0 dies while its KILL_SNAPSHOT-th DCP snapshot
    is being committed: every shard is on disk, the folder is still ``.step-N.partial``."""
    import ddptrain.snapshots.dcp as sharded

    target, marker = int(os.environ["KILL_SNAPSHOT"]), Path(os.environ["KILL_MARKER"])
    real_commit, calls = sharded.commit, {"n": 0}

    def dying_commit(future, meta, partial, final, keep, *rest):
        calls["n"] += 1
        if calls["n"] == target and _first_attempt(marker):
            future.result()
            marker.write_text(str(partial))
            os.kill(os.getpid(), signal.SIGKILL)
        return real_commit(future, meta, partial, final, keep, *rest)

    sharded.commit = dying_commit
    return digits_task(cfg)


def recording(cfg) -> Task:
    """Feature 0 of every sample is its index; each rank appends what it trains on to a file."""
    samples = int(os.environ.get("RECORD_SAMPLES", "200"))
    inputs = torch.zeros(samples, 4)
    inputs[:, 0] = torch.arange(samples, dtype=torch.float32)
    return Task(model=_Recorder(Path(os.environ["RECORD_DIR"])),
                train_set=TensorDataset(inputs, torch.zeros(samples, 1)), loss_fn=F.mse_loss)


class _Recorder(torch.nn.Module):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with open(self.out / f"rank-{os.environ['RANK']}.jsonl", "a") as handle:
            handle.write(json.dumps(x[:, 0].long().tolist()) + "\n")
        return self.linear(x[:, 1:])  # feature 0 (the index) only identifies the sample


def mlp_regression(cfg) -> Task:
    """The regression data with another model: its snapshots do not fit Linear(20, 1)."""
    task = regression_task(cfg)
    task.model = torch.nn.Sequential(torch.nn.Linear(20, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return task


class PlainDataset(torch.utils.data.Dataset):
    """The same samples without the TensorDataset type: forces the DataLoader path."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.inner[index]


def regression_via_dataloader(cfg) -> Task:
    task = regression_task(cfg)
    task.train_set = PlainDataset(task.train_set)
    return task


def digits_via_dataloader(cfg) -> Task:
    task = digits_task(cfg)
    task.train_set, task.eval_set = PlainDataset(task.train_set), PlainDataset(task.eval_set)
    return task


class _HalfUsed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(20, 1)
        self.unused = torch.nn.Linear(20, 1)  # gets no gradient: DDP must be told

    def forward(self, x):
        return self.used(x)


def unused_parameters(cfg) -> Task:
    task = regression_task(cfg)
    task.model = _HalfUsed()
    return task


class _SlowOnOneRank(torch.utils.data.Dataset):
    """The regression samples; on rank SLOW_RANK each item first sleeps SLOW_SECONDS, or,
    after HANG_AFTER items, forever (a rank stuck in user code)."""

    def __init__(self, inner):
        self.inner, self.served = inner, 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        if _rank() == int(os.environ.get("SLOW_RANK", "-1")):
            self.served += 1
            if self.served > int(os.environ.get("HANG_AFTER", "1000000000")):
                wait_for_ever()
            time.sleep(float(os.environ.get("SLOW_SECONDS", "0")))
        return self.inner[index]


def wait_for_ever():
    while True:
        time.sleep(3600)


def slow_data(cfg) -> Task:
    task = regression_task(cfg)
    task.train_set = _SlowOnOneRank(task.train_set)
    return task


def nan_sample(cfg) -> Task:
    """The regression data with one NaN feature in sample NAN_INDEX (default 100)."""
    task = regression_task(cfg)
    inputs, targets = task.train_set.tensors
    inputs = inputs.clone()
    inputs[int(os.environ.get("NAN_INDEX", "100")), 3] = float("nan")
    task.train_set = TensorDataset(inputs, targets)
    return task


kill_nan_sample = killable(nan_sample)


# --- bigger models -------------------------------------------------------------------------------
def mlp_34m(cfg) -> Task:
    """The benchmark's ~34M-parameter MLP with AdamW (ddptrain.bench.jobs), on 160 samples: 5 steps
    of 16 per rank (AdamW's state comes with the first step; a fragmenting allocator grows on)."""
    from ddptrain.bench.jobs import mlp34m_task

    task = mlp34m_task(cfg)
    task.train_set = Subset(task.train_set, range(160))
    return task


def small_gpt2(cfg) -> Task:
    """examples/hf_causal_lm.py's GPT-2 on a quarter of its training chunks (test time)."""
    import hf_causal_lm

    task = hf_causal_lm.gpt2_task(cfg)
    task.train_set = Subset(task.train_set, range(len(task.train_set) // 4))
    return task


kill_small_gpt2 = killable(small_gpt2)


def gpt2_lines(cfg) -> Task:
    """examples/hf_causal_lm.py's padded lines with a token-averaged loss, first 48 lines, no dropout."""
    import hf_causal_lm

    task = hf_causal_lm.gpt2_lines_task(cfg)
    task.train_set = Subset(task.train_set, range(48))
    for module in task.model.modules():  # no dropout: 1 and 2 ranks would draw different masks
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if os.environ.get("MEAN_PER_BATCH"):  # the per-batch mean: what the pair form replaces
        step = task.step_fn
        task.step_fn = lambda model, batch: (lambda total, count: total / count)(*step(model, batch))
    return task


def cnn(cfg) -> Task:
    """examples/image_classifier.py: dict samples, a transform, collate_fn, BatchNorm."""
    import image_classifier

    return image_classifier.cnn_task(cfg)


kill_cnn = killable(cnn)


kill_digits = killable(digits_task)


def left_in_eval_mode(cfg) -> Task:
    """digits with its model left in eval mode by the factory (as from_pretrained leaves one);
    each forward appends the mode it ran in to MODE_FILE."""
    task = digits_task(cfg)
    out = Path(os.environ["MODE_FILE"])

    def note_mode(module: torch.nn.Module, _: tuple) -> None:
        with open(out, "a") as handle:
            handle.write("train\n" if module.training else "eval\n")
    task.model.eval().register_forward_pre_hook(note_mode)
    return task


class _NormRecordingSGD(torch.optim.SGD):
    """SGD that appends the global gradient norm it is about to apply to GRAD_NORMS_FILE."""

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads).item()
        with open(os.environ["GRAD_NORMS_FILE"], "a") as handle:
            handle.write(f"{norm}\n")
        return super().step(closure)


def grad_norms(cfg) -> Task:
    """The regression task, recording the gradient norm of every optimizer step (rank files)."""
    task = regression_task(cfg)
    task.make_optimizer = lambda params: _NormRecordingSGD(params, lr=0.01)
    return task


def ddp_settings(cfg) -> Task:
    """The regression task through step_fn, which records (once) how DDP was set up."""
    task = regression_task(cfg)
    loss_fn, task.loss_fn, recorded = task.loss_fn, None, []

    def step(model, batch):
        if not recorded:
            recorded.append(1)
            inner = getattr(model, "module", model)
            settings = {"wrapper": type(model).__name__, "static_graph": getattr(model, "static_graph", None),
                        "bucket_bytes_cap": getattr(model, "bucket_bytes_cap", None),
                        "compiled": type(inner).__name__ == "OptimizedModule"}
            Path(os.environ["SETTINGS_FILE"]).write_text(json.dumps(settings))
        return loss_fn(model(batch[0]), batch[1])

    task.step_fn = step
    return task


def bench_via_dataloader(cfg) -> Task:
    """The benchmark's job (DDPTRAIN_BENCH_JOB) through the DataLoader path (benchmarks/gpu_check.sh)."""
    from ddptrain.bench.jobs import bench_task

    task = bench_task(cfg)
    task.train_set = PlainDataset(task.train_set)
    return task


# --- data sets that do not divide evenly, models with buffers ------------------------------------
def _small_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def uneven(cfg) -> Task:
    """A small MLP on the first UNEVEN_SAMPLES regression samples (the epoch's last global
    batch is short), SGD lr 0.05: large enough steps that a mis-weighted sample shows.
    UNEVEN_STEP_SLEEP: seconds of sleep per step (a run that must last, on a fast machine too)."""
    samples = int(os.environ.get("UNEVEN_SAMPLES", "600"))
    data = regression_task(cfg).train_set
    task = Task(model=_small_mlp(), train_set=TensorDataset(*(t[:samples] for t in data.tensors)),
                loss_fn=F.mse_loss, defaults={"lr": 0.05, "optimizer": "sgd"})
    pause = float(os.environ.get("UNEVEN_STEP_SLEEP", "0"))
    return _on_step(task, lambda n: time.sleep(pause)) if pause else task


def batchnorm(cfg) -> Task:
    """A BatchNorm MLP on 600 regression samples, evaluated on 200 others."""
    data = regression_task(cfg).train_set
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    return Task(model=model, train_set=TensorDataset(*(t[:600] for t in data.tensors)),
                eval_set=TensorDataset(*(t[600:800] for t in data.tensors)), loss_fn=F.mse_loss,
                defaults={"lr": 0.05, "optimizer": "sgd", "momentum": 0.9})


kill_uneven = killable(uneven)


# --- iterable training sets and token files (issue 20): tests/helpers/data_tasks.py ---------------
from data_tasks import (  # noqa: E402, F401 - re-exported: the tests name them here
    NumberStream,
    _stream_task,
    empty_stream,
    failing_stream,
    jsonl_stream,
    square_shares,
    stateless_stream,
    stream,
    token_file_lm,
    uneven_stream,
    write_jsonl_shards,
)

killable_stream = killable(stream)
killable_stateless_stream = killable(stateless_stream)
killable_jsonl_stream = killable(jsonl_stream)
killable_square_shares = killable(square_shares)


def stream_as_map(cfg) -> Task:
    """The same samples as ``stream`` in a map-style set read through a DataLoader (benchmarks)."""
    data = NumberStream(int(os.environ.get("STREAM_SAMPLES", "250")), cfg.seed)
    samples = PlainDataset(TensorDataset(data.inputs, data.targets, torch.arange(len(data.inputs))))
    return _stream_task(cfg, samples)


def paced(cfg) -> Task:
    """The regression task with STEP_SLEEP seconds per step: long enough to change membership mid-run."""
    pause = float(os.environ.get("STEP_SLEEP", "0.05"))
    return _on_step(regression_task(cfg), lambda n: time.sleep(pause))


def slow_steps(cfg) -> Task:
    """The regression task, each step first sleeping STEP_SLEEP seconds on every rank (a run that
    lasts long enough for something outside it to happen meanwhile); the same math. With
    STEP_GATE (a path), every rank waits before its second step until that file exists."""
    seconds, gate = float(os.environ.get("STEP_SLEEP", "0")), os.environ.get("STEP_GATE")

    def before(n: int) -> None:
        while gate and n == 2 and not Path(gate).exists():
            time.sleep(0.02)
        time.sleep(seconds)
    return _on_step(regression_task(cfg), before)



killed_twice = killed_on_schedule(slow_steps)


def noisy_regression(cfg) -> Task:
    """The regression data through a model with dropout, and a target with noise from torch's,
    Python's and numpy's generators, each drawn a number of times that differs by rank, so every
    rank's random states differ from the others': a resume that restored another rank's states, or
    none, is not bitwise the uninterrupted run (snapshots/rank_parts.py). No evaluation set (dropout
    would be off there anyway)."""
    import random

    import numpy as np

    task = regression_task(cfg)
    task.model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                     torch.nn.Linear(32, 1))
    task.eval_set, task.loss_fn = None, None
    rank = int(os.environ.get("RANK", "0"))

    def step(model, batch):
        inputs, target = batch
        torch.rand(rank + 1), [random.random() for _ in range(rank + 1)], np.random.rand(rank + 1)
        scale = 1e-2 * (random.random() + float(np.random.rand()))
        return F.mse_loss(model(inputs), target + scale * torch.randn_like(target))

    task.step_fn = step
    return task


kill_noisy = killable(noisy_regression)


def nanogpt_scheduled(cfg) -> Task:
    """The regression task under nanoGPT's schedule (ddptrain.optim.nanogpt_schedule): 4 steps of
    warm-up, a cosine to 1e-3 at iteration 10."""
    from ddptrain.optim import nanogpt_schedule

    task = regression_task(cfg)
    task.make_scheduler = nanogpt_schedule(warmup_iters=4, lr_decay_iters=10, min_lr=1e-3)
    return task


def optimizer_probe(cfg) -> Task:
    """The regression task under AdamW (its own, at --lr); before its first optimizer step, rank 0
    writes what the optimizer holds, by parameter name, and its groups' rates to $OPTIMIZER_PROBE."""
    task = regression_task(cfg)
    module, built, probed = task.model, [], []
    task.make_optimizer = lambda params: built.append(torch.optim.AdamW(params, lr=cfg.hparam("lr"))) or built[0]

    def step_fn(model, batch):
        if not probed and os.environ.get("RANK") == "0" and os.environ.get("OPTIMIZER_PROBE"):
            optimizer = built[0]
            state = {name: {k: v.clone() for k, v in optimizer.state[p].items()}
                     for name, p in module.named_parameters()}
            torch.save({"state": state, "lr": [g["lr"] for g in optimizer.param_groups]}, os.environ["OPTIMIZER_PROBE"])
        probed.append(True)
        inputs, targets = batch
        return F.mse_loss(model(inputs), targets)

    task.step_fn, task.loss_fn = step_fn, None
    return task
