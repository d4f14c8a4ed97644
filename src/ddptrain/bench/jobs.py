"""The jobs ``ddptrain bench`` runs: each one model, data set, optimizer and loss, which every
contender (bench/loops.py, and ddptrain through ``bench_task``) trains identically.

- ``tutorial``: the tutorial's ``Linear(20, 1)`` on 2048 regression samples, SGD.
- ``mlp``: a 20-1024-1024-1 MLP on 8192 regression samples, SGD.
- ``gpt2``: the GPT-2 of examples/hf_causal_lm.py (2 layers, 64 wide, byte tokens, 64 per
  sample; dropout off, so every contender computes the same steps) on the standard library's
  source, AdamW. Needs transformers (``ddptrain[hf]``).
- ``fsdp``: a ~34M-parameter MLP (32 blocks of 1024x1024) sharded with FSDP2, AdamW: each
  contender's FSDP (ddptrain ``--strategy fsdp``, a hand-written ``fully_shard`` loop,
  Lightning's ``ModelParallelStrategy``, Accelerate with the model sharded by the user).

Every contender seeds ``SEED`` before building the model, so all start from the same weights,
and samples with ``DistributedSampler(seed=SEED)`` (ddptrain's order is that permutation's
global batches), so all train on the same samples in the same order.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from ..tasks.protocol import Task
from ..tasks.regression import regression_data

SEED = 0
GPT2_SEQUENCE = 64


@dataclass(frozen=True)
class Job:
    name: str
    samples: int
    batch: int  # per rank
    model: Callable[[], torch.nn.Module]
    data: Callable[[int], Dataset]  # samples -> the training set
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]  # a batch, as a DataLoader gives it
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    tokens_per_sample: int | None = None
    sharded: bool = False  # FSDP2 on each block, then the root
    smoke_samples: int = 256  # under DDPTRAIN_BENCH_SMOKE (ddptrain bench --smoke: checks the plumbing)

    def size(self, smoke: bool) -> int:
        return self.smoke_samples if smoke else self.samples

    def train_set(self) -> Dataset:
        return self.data(self.size(bool(os.environ.get("DDPTRAIN_BENCH_SMOKE"))))

    def steps_per_epoch(self, nproc: int, smoke: bool) -> int:
        return -(-self.size(smoke) // (self.batch * nproc))


def bench_device(local_rank: int) -> torch.device:
    """Where the contenders train: DDPTRAIN_BENCH_DEVICE (``ddptrain bench --device``), CPU unless set."""
    kind = os.environ.get("DDPTRAIN_BENCH_DEVICE", "cpu")
    return torch.device(kind, local_rank) if kind == "cuda" else torch.device(kind)


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


def _sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def _mlp(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(20, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 1))


def mlp34m() -> torch.nn.Sequential:
    """32 blocks of Linear(1024, 1024) + ReLU between an input and an output layer: the blocks
    are a small part of the model, as in a transformer, so FSDP holds one or two whole at a time.
    Under DDPTRAIN_BENCH_SMOKE (``ddptrain bench --smoke``: the plumbing, not the figures) the same
    32 blocks 128 wide (0.5M parameters: the fsdp rows of the smoke test took half of its 2 minutes)."""
    width, blocks = (128 if os.environ.get("DDPTRAIN_BENCH_SMOKE") else 1024), 32
    return torch.nn.Sequential(torch.nn.Linear(20, width),
                               *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                                 for _ in range(blocks)],
                               torch.nn.Linear(width, 1))


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """What FSDP shards one at a time: mlp34m's blocks (every member but the first and last)."""
    return list(model)[1:-1]  # type: ignore[call-overload]  # a Sequential


def byte_corpus() -> bytes:
    """About 100 KB of English and Python from the standard library (examples/hf_causal_lm.py's text)."""
    return "".join(inspect.getsource(module) for module in (textwrap, json.decoder, argparse)).encode()


def gpt2_data(samples: int) -> TensorDataset:
    tokens = torch.tensor(list(byte_corpus()), dtype=torch.long)
    chunks = tokens[: len(tokens) // GPT2_SEQUENCE * GPT2_SEQUENCE].view(-1, GPT2_SEQUENCE)
    return TensorDataset(chunks[:samples])


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=GPT2_SEQUENCE, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # built from a config, not from_pretrained: name the loss
    return model


def _next_byte(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    (tokens,) = batch
    return model(input_ids=tokens, labels=tokens).loss


JOBS = {
    "tutorial": Job("tutorial", 2048, 32, lambda: torch.nn.Linear(20, 1), lambda n: regression_data(SEED, n),
                    _mse, _sgd),
    "mlp": Job("mlp", 8192, 32, lambda: _mlp(1024), lambda n: regression_data(SEED, n), _mse, _sgd),
    "gpt2": Job("gpt2", 1536, 16, gpt2, gpt2_data, _next_byte,
                lambda params: torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0),
                tokens_per_sample=GPT2_SEQUENCE),
    "fsdp": Job("fsdp", 512, 16, mlp34m, lambda n: regression_data(SEED, n), _mse,
                lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0), sharded=True,
                smoke_samples=96),
}


def bench_task(cfg: Any) -> Task:
    """The job named by DDPTRAIN_BENCH_JOB as a ddptrain task (``--task ddptrain.bench.jobs:bench_task``);
    its loss ticks the bench's step clock (bench/clock.py)."""
    from .clock import clock

    job = JOBS[os.environ.get("DDPTRAIN_BENCH_JOB", "tutorial")]
    tick = clock()

    def step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        tick()
        return job.loss(model, batch)

    return Task(model=job.model(), train_set=job.train_set(), step_fn=step, make_optimizer=job.optimizer,
                blocks=blocks_of if job.sharded else None, tokens_per_sample=job.tokens_per_sample)


def mlp34m_task(cfg: Any) -> Task:
    """The fsdp job's model and optimizer on DDPTRAIN_BENCH_SAMPLES samples (benchmarks/fsdp_memory.py)."""
    job = JOBS["fsdp"]
    samples = int(os.environ.get("DDPTRAIN_BENCH_SAMPLES", str(job.samples)))
    return Task(model=job.model(), train_set=regression_data(cfg.seed, samples), loss_fn=F.mse_loss,
                make_optimizer=job.optimizer, blocks=blocks_of)


def final_loss(job: Job, weights: dict[str, torch.Tensor]) -> float:
    """The mean training loss over the whole data set under the final weights: the same job ends
    at the same loss."""
    model = job.model()
    model.load_state_dict(weights)
    data = job.train_set()
    with torch.no_grad():
        size = len(data)  # type: ignore[arg-type]  # a TensorDataset: it has a length
        batches = [data[i: i + 256] for i in range(0, size, 256)]
        return sum(job.loss(model, batch).item() * len(batch[0]) for batch in batches) / size
