"""``--ema DECAY``: an exponential moving average of the weights, kept where the weights are.

Each trainable parameter's average is a tensor like the parameter itself: under fsdp a DTensor
with the parameter's placements, so each rank holds the average of its own shard and the
average costs what the weights cost per rank. Every ``--ema-every``-th optimizer step,
``average = decay * average + (1 - decay) * weights`` is one fused lerp over this rank's local
tensors: no communication. The average starts at the weights the run starts from (after
``--init-from``, those it loaded).

It is part of the weights' state (``ModelAndOptimizer``): a DCP snapshot shards it as it
shards the model, a file snapshot holds it whole, and either resumes on the other strategy or
another world size. Evaluation and the final ``ema/model.pt`` swap it into the parameters
(``swapped_in``), so the model's own forward (FSDP's all-gathers included) runs on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

EMA_DIR = "ema"  # RUN_DIR/ema/model.pt: the average at the end of the run


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard, shared storage), else itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# torch's checkpoint_wrapper (--activation-checkpointing) puts its module under this name; torch's
# state-dict functions leave it out of the model's keys, and so does the average's state (a run
# saved with activation checkpointing resumes without it, and back).
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."


def model_key(name: str) -> str:
    """A parameter's name as the model's state dict names it."""
    return name.replace(CHECKPOINT_WRAPPED, "")


class WeightAverage:
    def __init__(self, module: torch.nn.Module, decay: float, every: int = 1) -> None:
        """``module``: the unwrapped model, after the strategy wrapped it (its parameters are
        then what the optimizer steps: DTensors under fsdp)."""
        self.decay, self.every = decay, every
        self.params = {model_key(name): p for name, p in module.named_parameters() if p.requires_grad}
        self.average = {name: p.detach().clone() for name, p in self.params.items()}

    @torch.no_grad()
    def update(self, global_step: int) -> None:
        """After optimizer step ``global_step`` (1-based) was taken."""
        if global_step % self.every:
            return
        averages = [local(a) for a in self.average.values()]
        torch._foreach_lerp_(averages, [local(p) for p in self.params.values()], 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self, settle: Callable[[], None] = lambda: None) -> Iterator[None]:
        """The average in the parameters while the block runs (evaluation, ema/model.pt), the
        weights back after it. ``settle``: makes the strategy drop what it gathered from the
        parameters (FSDP's root keeps its gathered parameters after a forward without backward)."""
        settle()
        self._swap()
        try:
            yield
        finally:
            settle()
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for name, param in self.params.items():
            weights, average = local(param), local(self.average[name])
            kept = weights.clone()  # one tensor at a time: the swap costs the largest, not the model
            weights.copy_(average)
            average.copy_(kept)

    @torch.no_grad()
    def restart(self) -> None:
        """The average starts again at the weights (a fresh start after --init-from loaded them)."""
        for name, param in self.params.items():
            local(self.average[name]).copy_(local(param))

    # --- state: by parameter name, like the model's ------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.average)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any] | None, whole: bool) -> None:
        """``state``: as saved (None or empty: a snapshot from a run without --ema; the average
        starts at the weights just loaded). ``whole``: whole tensors (a file snapshot) for
        this run's shards; otherwise DCP already loaded them in place."""
        if not state:
            self.restart()
            return
        if not whole:
            return
        state = {model_key(name): value for name, value in state.items()}  # (before 0.7: the wrapper's names)
        for name, average in self.average.items():
            saved = state[name].to(local(average).device)
            if isinstance(average, DTensor):  # this rank's shard of the whole tensor, sliced here
                saved = distribute_tensor(saved, average.device_mesh, average.placements,
                                          src_data_rank=None).to_local()
            local(average).copy_(saved)

    def local_bytes(self) -> int:
        return sum(local(a).numel() * local(a).element_size() for a in self.average.values())
