"""Nothing non-finite is ever saved.

Default: no host synchronisation per step. Each step's loss already lands in the epoch's
loss slots on the device (observe/metrics.EpochLosses); before every snapshot, evaluation, epoch
record and ``model.pt`` the ranks reduce "the first step whose loss was not finite" (folded
into a reduction that happens there anyway) and check their weights. A bad step stops the
run with one line naming the step, its epoch and the rank(s); the snapshots already on
disk are all finite, so the last good one survives rotation.

``--skip-nonfinite N``: every step, each rank checks its loss and its (all-reduced)
gradients and the ranks agree with one tiny all-reduce; a bad step is skipped by every rank
together (no optimizer step, no scaler update), recorded in metrics.jsonl, and the run stops
at the N+1-th.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import NonFiniteError

REMEDY = ("find the bad sample or lower --lr, or pass --skip-nonfinite N to skip such steps "
          "on every rank together")


def local_all_finite(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """Whether this rank's tensors (its shards, under fsdp) hold no NaN or infinity: a boolean
    on the device, so checking costs no host synchronisation by itself."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
    checks = [torch.isfinite(t.detach()).all() for t in local if t.numel()]
    return torch.stack(checks).all() if checks else torch.tensor(True)


class NonFiniteGuard:
    def __init__(self, skip_limit: int) -> None:
        self.skip_limit = skip_limit
        self.skipped: list[int] = []  # global steps skipped (in snapshots: resume stays exact)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": list(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = list(state.get("skipped_steps", []))

    @property
    def skipping(self) -> bool:
        return self.skip_limit > 0

    def skipped_after(self, step: int) -> list[int]:
        """The steps skipped after global step ``step`` (an epoch's: after the one before it)."""
        return [s for s in self.skipped if s > step]

    def check(self, first_bad_steps: list[int], weights_finite: bool, step: int, epoch: int,
              last_snapshot: str | None) -> None:
        """Raise NonFiniteError if any rank saw a non-finite loss or holds non-finite weights.

        ``first_bad_steps``: every rank's first non-finite step (0: none) of the current
        ``epoch`` (the losses are reduced within an epoch); ``weights_finite``: on every rank.
        Both already reduced over the ranks."""
        bad = {rank: s for rank, s in enumerate(first_bad_steps) if s > 0}
        kept = f"last good snapshot: {last_snapshot}" if last_snapshot else "no snapshot was written"
        if bad:
            first = min(bad.values())
            ranks = ", ".join(str(r) for r, s in bad.items() if s == first)
            raise NonFiniteError(f"the loss was not finite at step {first} (epoch {epoch}) on "
                                 f"rank {ranks}; nothing non-finite was saved ({kept}); {REMEDY}")
        if not weights_finite:
            raise NonFiniteError(f"the weights stopped being finite before step {step} (a non-finite "
                                 f"gradient with a finite loss); nothing non-finite was saved ({kept}); {REMEDY}")

    def step_is_finite(self, loss: torch.Tensor, grads: list[torch.Tensor]) -> bool:
        """--skip-nonfinite: every rank's answer for this step, the same on every rank."""
        sharded = any(hasattr(g, "to_local") for g in grads)
        if grads and not sharded:  # one fused norm: non-finite when any element is
            grads_ok = torch.isfinite(torch.nn.utils.get_total_norm(grads))
        else:  # FSDP's shards can be empty, which norms refuse: check each
            grads_ok = local_all_finite(grads).to(loss.device)
        flag = (~(torch.isfinite(loss.detach()) & grads_ok)).to(torch.float32).reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the default group: where the gradients meet
        return not bool(flag.item())

    def skip(self, step: int) -> None:
        self.skipped.append(step)
        if len(self.skipped) > self.skip_limit:
            shown = ", ".join(map(str, self.skipped[:10]))
            raise NonFiniteError(f"{len(self.skipped)} steps had a non-finite loss or gradient (steps {shown}), "
                                 f"more than --skip-nonfinite {self.skip_limit}; the bad steps were skipped and "
                                 "nothing non-finite was saved; find the bad samples or lower --lr")
