"""ddptrain beside nanoGPT's own train.py, on the same data, model and schedule, on 1 and 2 CPU ranks:
the learning rate at every iteration (nanoGPT's as its own get_lr set it, ours as the step
records hold it), and the training losses at the first and last iterations.

    python benchmarks/vs_nanogpt.py --nanogpt PATH/TO/nanoGPT [--iters 30]

PATH is a checkout of karpathy/nanoGPT (its train.py and model.py are run as they are, but for
the lines a CPU needs, below). The data: examples/nanogpt/prepare.py's characters (train.bin,
val.bin, meta.pkl in nanoGPT's format). The model: nanoGPT's own GPT (2 layers, 2 heads, 64
wide, block 64), its configure_optimizers, in a ddptrain task with nanogpt_schedule, the global
batch the same (16 x 2 micro-batches on 1 rank, 16 x 1 on each of 2).

What differs by design, and so is not compared bit for bit: nanoGPT draws random windows with
replacement from torch.manual_seed(1337 + rank) and builds its model after that seed; ddptrain
reads every window once per epoch in a seeded order and builds the model from --seed. The
initial losses agree (both ~ln(vocab)); the final ones are alike, not equal.

nanoGPT's train.py on CPU: run alone it needs only --device=cpu --compile=False; under torchrun
three lines assume CUDA, changed here in a copy: ``device = f'cuda:{ddp_local_rank}'`` (to
'cpu'), ``torch.cuda.set_device(device)`` (dropped) and ``DDP(model, device_ids=[...])`` (no
device_ids on a CPU module); its log line is given the rate it stepped at.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).parents[1]
MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "dropout": 0.0, "bias": False}
BATCH, ACCUM, LR, MIN_LR, WARMUP = 16, 2, 1e-3, 1e-4, 5

TASK = '''
import pickle

import ddptrain
from ddptrain.data import TokenFile
from ddptrain.optim import nanogpt_schedule
from model import GPT, GPTConfig


def task(cfg):
    with open("data/chars/meta.pkl", "rb") as f:
        vocab = pickle.load(f)["vocab_size"]
    model = GPT(GPTConfig(vocab_size=vocab, **{MODEL!r}))

    def step_fn(model, batch):
        inputs, targets = batch
        return model(inputs, targets)[1]

    def eval_fn(model, batch):
        inputs, targets = batch
        return {{"loss": model(inputs, targets)[1] * len(inputs), "samples": len(inputs)}}

    block = {MODEL[block_size]!r}
    return ddptrain.Task(
        model=model, train_set=TokenFile("data/chars/train.bin", block),
        eval_set=TokenFile("data/chars/val.bin", block),
        step_fn=step_fn, eval_fn=eval_fn, tokens_per_sample=block,
        make_optimizer=lambda params: model.configure_optimizers(0.1, cfg.hparam("lr"), (0.9, 0.99), "cpu"),
        make_scheduler=nanogpt_schedule({WARMUP}, {ITERS}, {MIN_LR}))
'''

CPU_PATCHES = [  # (nanoGPT's line, what it becomes on CPU under torchrun)
    ("device = f'cuda:{ddp_local_rank}'", "device = 'cpu'"),
    ("torch.cuda.set_device(device)", "pass"),
    ("DDP(model, device_ids=[ddp_local_rank])", "DDP(model)"),
    ('print(f"iter {iter_num}: loss {lossf:.4f},', 'print(f"iter {iter_num}: lr {lr!r}, loss {lossf:.4f},'),
]


def prepare(nanogpt: Path, work: Path, iters: int) -> None:
    """nanoGPT's train.py (patched for CPU) and model.py, our task beside them, the data in data/chars."""
    train = (nanogpt / "train.py").read_text()
    for before, after in CPU_PATCHES:
        if before not in train:
            sys.exit(f"vs_nanogpt: {nanogpt}/train.py has no line {before!r}: another nanoGPT than this script knows")
        train = train.replace(before, after)
    (work / "train.py").write_text(train)
    shutil.copy(nanogpt / "model.py", work / "model.py")
    shutil.copy(nanogpt / "configurator.py", work / "configurator.py")
    (work / "vs_task.py").write_text(TASK.format(MODEL=MODEL, WARMUP=WARMUP, ITERS=iters, MIN_LR=MIN_LR))
    data = work / "data" / "chars"
    data.mkdir(parents=True)
    subprocess.run([sys.executable, str(REPO / "examples" / "nanogpt" / "prepare.py")], cwd=data, check=True)


def nanogpt_run(work: Path, ranks: int, iters: int) -> dict[int, tuple[float, float]]:
    """{iteration: (lr, loss)} from nanoGPT's own log lines."""
    flags = [f"--{k}={v}" for k, v in {
        "dataset": "chars", "device": "cpu", "compile": False, "dtype": "float32", "backend": "gloo",
        "batch_size": BATCH, "gradient_accumulation_steps": ACCUM, "max_iters": iters, "lr_decay_iters": iters,
        "learning_rate": LR, "min_lr": MIN_LR, "warmup_iters": WARMUP, "beta2": 0.99, "eval_interval": 10 ** 6,
        "eval_iters": 1, "log_interval": 1, "always_save_checkpoint": False, "out_dir": f"out-{ranks}",
        **MODEL}.items()]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
              if ranks > 1 else [sys.executable])
    out = subprocess.run([*launch, "train.py", *flags], cwd=work, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        sys.exit(f"vs_nanogpt: nanoGPT's train.py failed on {ranks} rank(s):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    found = re.findall(r"iter (\d+): lr ([\d.e-]+), loss ([\d.]+)", out.stdout)
    return {int(it): (float(lr), float(loss)) for it, lr, loss in found}


def ddptrain_run(work: Path, ranks: int, iters: int) -> dict[int, tuple[float, float]]:
    """{iteration: (lr, loss)}: iteration N's rate is the step record's after N steps (the rate the
    next step takes), its loss the record's after N + 1 (that step's)."""
    run_dir = work / f"ddptrain-{ranks}"
    args = ["train", "--task", "vs_task:task", "--nproc", str(ranks), "--batch-size", str(BATCH),
            "--grad-accum", str(ACCUM // ranks), "--lr", str(LR), "--max-steps", str(iters + 1), "--log-every", "1",
            "--eval-every", "0", "--eval-batches", "1", "--final-eval", "same", "--run-dir", str(run_dir)]
    out = subprocess.run([str(Path(sys.executable).with_name("ddptrain")), *args], cwd=work, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        sys.exit(f"vs_nanogpt: ddptrain failed on {ranks} rank(s):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if r["kind"] == "step"}
    return {it: (steps[it]["lr"] if it in steps else math.nan, steps[it + 1]["train_loss"])
            for it in range(iters + 1) if it + 1 in steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--iters", type=int, default=30, help="nanoGPT's max_iters (ddptrain: --max-steps + 1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vs-nanogpt-") as folder:
        work = Path(folder)
        prepare(args.nanogpt.resolve(), work, args.iters)
        for ranks in (1, 2):
            theirs, ours = nanogpt_run(work, ranks, args.iters), ddptrain_run(work, ranks, args.iters)
            shared = sorted(set(theirs) & set(ours))
            rate_gap = max((abs(theirs[it][0] - ours[it][0]) / theirs[it][0] for it in shared
                            if not math.isnan(ours[it][0])), default=math.nan)
            print(f"\n{ranks} rank(s), {len(shared)} iterations: the largest relative difference of the rates "
                  f"{rate_gap:.1e}")
            print(f"{'iter':>5} {'lr nanoGPT':>12} {'lr ddptrain':>12} {'loss nanoGPT':>13} {'loss ddptrain':>14}")
            for it in shared:
                if it in (shared[0], shared[1], WARMUP, args.iters // 2, shared[-1]):
                    (lr_a, loss_a), (lr_b, loss_b) = theirs[it], ours[it]
                    ours_lr = "-" if math.isnan(lr_b) else f"{lr_b:.6g}"  # (no step record before step 1)
                    print(f"{it:>5} {lr_a:>12.6g} {ours_lr:>12} {loss_a:>13.4f} {loss_b:>14.4f}")


if __name__ == "__main__":
    main()
