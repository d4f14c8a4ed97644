"""One process as rank r of W: torch's fake process group (``torch.testing._internal.distributed.fake_pg``);
and, for a model that does not fit this machine, fake tensors.

Its collectives return at once and reach no other process, so
the real strategy, data split, step and optimizer run as they would at the target scale, on
one machine, without a rendezvous or a peer. The one part of torch that needs more: DDP's
reducer requires its all-reduce's future to hold the bucket, and the fake group's holds
nothing, so a planned DDP model gets a hook that starts the same all-reduce as the hook the
run would use and hands the bucket back (``plan_comm_hook``).

Fake tensors (``fake_tensors``, ``ddptrain plan --fake-tensors``) have a shape, a dtype and a
device but no data: the task factory builds its model and data under torch's FakeTensorMode,
and every step after computes shapes, not numbers. What a rank holds and sends is the same
(compared figure by figure with real tensors); the time is not the arithmetic's but Python's
per op, which FSDP's wrapping pays once per rank and parameter (GPT-2 at 1,024 ranks: 28 s).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

# The all-reduce each of ddptrain's --comm-hook names sends for a bucket: its dtype (None: the
# bucket's own). PowerSGD sends plain all-reduces for its warm-up (parallel/hooks.py), which
# is what a plan of a few steps sees too.
HOOK_DTYPES: dict[str, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16,
                                              "powersgd": None}


@contextlib.contextmanager
def as_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process is rank ``rank`` of ``world_size`` until the block ends; nothing is sent."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("ddptrain plan runs outside a job: this process is already in a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def plan_comm_hook(name: str) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """A DDP comm hook sending what --comm-hook ``name`` sends per bucket, whose future holds
    the bucket (the fake group's own holds nothing, which DDP's reducer refuses)."""
    dtype = HOOK_DTYPES[name]

    def hook(state, bucket):  # (unannotated: DDP refuses any annotation but the class itself, a string here)
        buffer = bucket.buffer()
        sent = buffer if dtype is None else buffer.to(dtype)
        dist.all_reduce(sent, async_op=True).wait()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    return hook


def fake_tensors() -> contextlib.AbstractContextManager[Any]:
    """torch's FakeTensorMode for building a task: its tensors take no memory, and every op on
    them later (outside the block too) computes only their shapes; real tensors meeting them
    (a batch of a real data set, a sampler's indices) are taken as fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)
