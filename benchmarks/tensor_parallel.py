"""A tensor-parallel step beside FSDP's and DDP's, on this machine's CPU: 2 ranks over gloo, the
same global batch (32 sequences), a Llama-shaped model (4 blocks 256 wide: attention with separate
q, k, v, o without biases and 8 heads, a gated MLP 4x wide; 4.2M parameters) split by the plan
torchtitan writes for it, AdamW. Contenders:

- ``ddp``: ``ddptrain train --strategy ddp`` (16 a rank);
- ``fsdp``: ``--strategy fsdp`` (16 a rank, each block a unit);
- ``fsdp --tp 2``: one data-parallel rank of 2 tensor-parallel ones (32 a group);
- ``hand-written tp loop``: the same split by hand, torch's parallelize_module and fully_shard on
  the same (1, 2) mesh, in a torchrun script of its own (this file, ``--loop``): what ddptrain
  adds over it; under glibc's allocator, and under mimalloc with ddptrain's settings (ddptrain's
  CPU ranks run under mimalloc: launch/allocator.py).

    python benchmarks/tensor_parallel.py [--reps 3] [--steps 60]

samples/s: the median over each run's 10-step windows after the first (ddptrain's step records
at ``--log-every 10``; the loop times the same windows on rank 0), then the median over the
repetitions, whose order rotates; the ranges are the spread. Model state: parameters, gradients
and AdamW's moments on the largest rank (ddptrain's epoch record). These are CPU figures: a CPU's
all-reduce is a copy through memory, where a GPU node's runs over NVLink, and two ranks share two
cores; they say what TP costs in collectives and bookkeeping here, not what it gains on GPUs.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from ddptrain import Task
from ddptrain.launch.allocator import MIMALLOC_SETTINGS, mimalloc_path

WIDTH, HEADS, SEQUENCE, BLOCKS, SAMPLES, GLOBAL_BATCH = 256, 8, 32, 4, 8192, 32
PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.o": "rowwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.gate": "colwise",
        "blocks.*.mlp.down": "rowwise"}
WINDOW = 10
HERE = Path(__file__).resolve().parent


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape  # the heads counted from q's output: a share of them under --tp
        q, k, v = (part(x).view(batch, steps, -1, WIDTH // HEADS).transpose(1, 2) for part in (self.q, self.k, self.v))
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(mixed.transpose(1, 2).reshape(batch, steps, -1))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.gate = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def data() -> TensorDataset:
    inputs = torch.randn(SAMPLES, SEQUENCE, WIDTH, generator=torch.Generator().manual_seed(0))
    return TensorDataset(inputs, inputs[:, :, :3].sum(dim=(1, 2)).unsqueeze(1) / 8)


def task(cfg) -> Task:
    """The ddptrain contenders' task (``--task tensor_parallel:task``, this folder on the path)."""
    torch.manual_seed(cfg.seed)
    return Task(model=Model(), train_set=data(), loss_fn=F.mse_loss, tp_plan=PLAN,
                defaults={"optimizer": "adamw", "lr": 1e-3})


def loop(steps: int, out: Path) -> None:
    """The hand-written contender, one rank of it under torchrun: rank 0 writes its window rates."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Model()
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh["tp"], {name: styles[style]() for pattern, style in PLAN.items()
                                           for name, _ in model.named_modules() if fnmatch.fnmatchcase(name, pattern)})
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = data().tensors
    batch = GLOBAL_BATCH // mesh["dp"].size()
    stamps = []
    for step in range(steps):
        start = (step * mesh["dp"].size() + mesh["dp"].get_local_rank()) * batch % (SAMPLES - batch)
        F.mse_loss(model(inputs[start:start + batch]), targets[start:start + batch]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % WINDOW == 0:
            stamps.append(time.perf_counter())
    if dist.get_rank() == 0:
        rates = [WINDOW * GLOBAL_BATCH / (b - a) for a, b in zip(stamps, stamps[1:])]
        (out / "rates.json").write_text(json.dumps(rates))
    dist.destroy_process_group()


TRAIN = ["-m", "ddptrain", "train", "--task", "tensor_parallel:task", "--nproc", "2", "--log-every", str(WINDOW),
         "--save-seconds", "0"]
CONTENDERS = {"ddp": TRAIN + ["--strategy", "ddp", "--batch-size", "16"],
              "fsdp": TRAIN + ["--strategy", "fsdp", "--batch-size", "16"],
              "fsdp --tp 2": TRAIN + ["--strategy", "fsdp", "--tp", "2", "--batch-size", "32"],
              "hand-written tp loop": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                       str(HERE / "tensor_parallel.py"), "--loop"]}
MIMALLOC = mimalloc_path()  # ddptrain's ranks run under mimalloc: the loop under it too, with ddptrain's settings
ALLOCATOR = {"hand-written tp loop, mimalloc": {**MIMALLOC_SETTINGS, "LD_PRELOAD": str(MIMALLOC)}} if MIMALLOC else {}
if MIMALLOC is not None:
    CONTENDERS["hand-written tp loop, mimalloc"] = CONTENDERS["hand-written tp loop"]


def run(name: str, steps: int) -> dict[str, float]:
    """One contender's run: its median window rate, and (ddptrain) its largest rank's model state."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **ALLOCATOR.get(name, {})}
    with tempfile.TemporaryDirectory() as out:
        command = CONTENDERS[name]
        place = ["--steps", str(steps), "--out", out] if "--loop" in command else \
            ["--max-steps", str(steps), "--run-dir", out]
        subprocess.run([sys.executable, *command, *place], check=True, capture_output=True, env=env)
        if "--loop" in command:
            return {"samples_per_s": statistics.median(json.loads((Path(out) / "rates.json").read_text())),
                    "state_mb": float("nan")}
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        rates = [r["samples_per_s"] for r in records if r["kind"] == "step"][1:]
        last = [r for r in records if r["kind"] == "epoch"][-1]
        return {"samples_per_s": statistics.median(rates), "state_mb": last["memory_mb"]["model_state_mb"]["max"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)  # a hand-written rank
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop:
        return loop(args.steps, args.out)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
    for rep in range(args.reps):
        turn = rep % len(CONTENDERS)
        for name in list(CONTENDERS)[turn:] + list(CONTENDERS)[:turn]:
            results[name].append(run(name, args.steps))
            print(f"  rep {rep} {name:22s} {results[name][-1]}", flush=True)
    fsdp = statistics.median(r["samples_per_s"] for r in results["fsdp"])
    loop_rate = statistics.median(r["samples_per_s"] for r in results["hand-written tp loop"])
    print(f"\nCPU, 2 ranks over gloo (not a GPU node's figures)\n{'contender':32s} {'samples/s (min-max)':>22s} "
          f"{'vs fsdp':>8s} {'vs tp loop':>11s} {'model state MB/rank':>20s}")
    for name, runs in results.items():
        rates = [r["samples_per_s"] for r in runs]
        rate = statistics.median(rates)
        print(f"{name:32s} {f'{rate:.0f} ({min(rates):.0f}-{max(rates):.0f})':>22s} {rate / fsdp:8.2f} "
              f"{rate / loop_rate:11.2f} {statistics.median(r['state_mb'] for r in runs):20.1f}")


if __name__ == "__main__":
    main()
