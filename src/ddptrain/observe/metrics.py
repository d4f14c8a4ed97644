"""Numbers that need every rank: the epoch's training loss, gradient norms, per-rank timings
and memory. (The exact evaluation is observe/evaluation.py.)

Training losses stay on the device, one slot per step of the epoch; reading them costs
one all-reduce per epoch instead of a host synchronisation per step, and the same slots
tell the non-finite guard the first step whose loss was not finite.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


class EpochLosses:
    """This rank's per-step losses since the epoch began (or since a resume), on the device."""

    def __init__(self, device: torch.device, capacity: int, carries: bool = True) -> None:
        """``capacity``: steps per epoch (a guess for a stream: the slots grow); ``carries``: this
        rank adds a resumed epoch's loss so
        far into its next reduction (rank 0 alone, as the sums are over every rank)."""
        self.device, self.capacity, self.carries = device, max(1, capacity), carries
        self.reset(first_step=0)

    def reset(self, first_step: int, carried: tuple[float, int] = (0.0, 0)) -> None:
        """``first_step``: the global step of the next loss; ``carried``: (sum, steps) already
        reduced over every rank before a resume (rank 0 carries them, the others 0)."""
        self.slots = torch.zeros(self.capacity, dtype=torch.float64, device=self.device)
        self.count, self.first_step, self.carried = 0, first_step, carried
        self.reduced = (0.0, 0)

    def note_reduced(self, total: float, steps: int) -> None:
        """The epoch's (sum, steps) so far over every rank, as just reduced (before a snapshot)."""
        self.reduced = (total, steps)

    # In a snapshot: the epoch's loss so far over every rank (reduced just before saving).
    def state_dict(self) -> dict[str, Any]:
        return {"epoch_loss_total": self.reduced[0], "epoch_loss_steps": self.reduced[1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state``: the snapshot's progress table (``global_step``: where the next loss goes)."""
        saved = (state.get("epoch_loss_total", 0.0), state.get("epoch_loss_steps", 0))
        self.reset(state["global_step"], carried=saved if self.carries else (0.0, 0))

    def add(self, loss: torch.Tensor) -> None:
        if self.count == len(self.slots):  # a stream's epoch, longer than guessed: twice the room
            self.slots = torch.cat([self.slots, torch.zeros_like(self.slots)])
        self.slots[self.count] = loss.detach()  # one copy, promoted to float64, no host sync
        self.count += 1

    def local_sum(self) -> torch.Tensor:
        return self.slots[:self.count].sum() + self.carried[0]

    def local_steps(self) -> int:
        return self.count + self.carried[1]

    def first_nonfinite_step(self) -> torch.Tensor:
        """The step number (1-based, global) of this rank's first non-finite loss, or 0; on the device."""
        if not self.count:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        bad = ~torch.isfinite(self.slots[:self.count])
        index = torch.argmax(bad.to(torch.int8)).double()
        return torch.where(bad.any(), index + self.first_step + 1, 0.0)


class GradNorms:
    """Each step's gradient norm before clipping, kept on the device (no host sync per step):
    this rank's sum of squares of its gradients (its shards under fsdp; under ddp rank 0's
    alone, as every rank holds the same gradients), summed over the ranks with the epoch's
    other figures (Trainer._reduce), then the square root: the epoch's mean and largest norm."""

    def __init__(self, device: torch.device, capacity: int, counted: Callable[[list[torch.Tensor]], list[torch.Tensor]],
                 carries: bool = True) -> None:
        """``counted``: this rank's tensors among its gradients, whose squares sum over the ranks to
        the norm's (Strategy.counted_gradients: fsdp every rank's shards; ddp rank 0's); ``carries``:
        this rank holds a resumed epoch's figures so far (rank 0, which writes the record)."""
        self.device, self.capacity, self.counted, self.carries = device, max(1, capacity), counted, carries
        self.reset()

    def reset(self, carried: tuple[float, int, float] = (0.0, 0, 0.0)) -> None:
        self.slots = torch.zeros(self.capacity, dtype=torch.float64, device=self.device)
        self.count, self.carried, self.reduced = 0, carried, carried

    @torch.no_grad()
    def add(self, grads: list[torch.Tensor]) -> None:
        if self.count == len(self.slots):  # a stream's epoch, longer than guessed
            self.slots = torch.cat([self.slots, torch.zeros_like(self.slots)])
        grads = self.counted(grads)
        if grads:
            # Three ops, each ~5-10 us on a CPU (the tutorial's whole step is ~0.4 ms): one fused norm
            # per tensor (in the gradients' dtype: asked for float64, CPU kernels ran 1.5x the whole
            # step of a 1M-parameter MLP), then their norm in float64, written into this step's slot.
            norms = torch.stack(torch._foreach_norm(grads))
            torch.linalg.vector_norm(norms, dtype=torch.float64, out=self.slots[self.count])
        self.count += 1

    def last(self) -> torch.Tensor:
        """The newest step's norm (this rank's part), on the device."""
        return self.slots[self.count - 1]

    def local_squares(self) -> torch.Tensor:
        """This rank's squares, one per step since the epoch began (the same length on every rank)."""
        return self.slots[:self.count].square()

    def figures(self, squares: torch.Tensor) -> dict[str, float]:
        """``squares`` summed over the ranks: ``grad_norm`` (mean) and ``grad_norm_max`` over the
        epoch's steps whose norm is finite (a skipped step's is not), a resumed epoch's earlier
        steps included; also kept for the next snapshot."""
        norms = squares.sqrt()
        total, steps, largest = self.carried
        for norm in norms[torch.isfinite(norms)].tolist():  # one by one: a resumed epoch adds up the same
            total, steps, largest = total + norm, steps + 1, max(largest, norm)
        self.reduced = (total, steps, largest)
        return {"grad_norm": total / steps, "grad_norm_max": largest} if steps else {}

    # In a snapshot: the epoch's figures so far over every rank (reduced just before saving).
    def state_dict(self) -> dict[str, Any]:
        total, steps, largest = self.reduced
        return {"epoch_grad_norm_total": total, "epoch_grad_norm_steps": steps, "epoch_grad_norm_max": largest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (state.get("epoch_grad_norm_total", 0.0), state.get("epoch_grad_norm_steps", 0),
                 state.get("epoch_grad_norm_max", 0.0))
        self.reset(carried=saved if self.carries else (0.0, 0, 0.0))


# --- per-rank timings (stragglers) and memory ------------------------------------------------
TIMING_NAMES = ("data_s", "compute_s", "collective_s")
MEMORY_NAMES = ("peak_rss_mb", "model_state_mb")


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def return_free_memory() -> None:
    """Hand the C allocator's free pages back to the OS now (mimalloc's ``mi_collect``, glibc's
    ``malloc_trim``), before a large allocation of another shape: freed blocks that it cannot
    reuse would otherwise stay resident beside it (mimalloc purges after a delay of 1 s)."""
    import ctypes

    process = ctypes.CDLL(None)  # the allocator this process runs under, preloaded or glibc's
    if hasattr(process, "mi_collect"):
        process.mi_collect(ctypes.c_bool(True))
    elif hasattr(process, "malloc_trim"):
        process.malloc_trim(0)


def model_state_mb(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, extra_bytes: int = 0) -> float:
    """Parameters, gradients and optimizer state held by this rank (its shards under fsdp), and
    ``extra_bytes`` (--ema's average)."""
    def local_bytes(t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    held = sum(local_bytes(p) + local_bytes(p.grad) for p in params)
    held += sum(local_bytes(v) for state in optimizer.state.values() for v in state.values())
    return (held + extra_bytes) / 2**20


def memory_record(per_rank: list[list[float]]) -> dict[str, Any]:
    """The largest process's peak RSS and model state, and which rank it was."""
    record = {}
    for column, name in enumerate(MEMORY_NAMES):
        values = [rank_values[column] for rank_values in per_rank]
        largest = max(range(len(values)), key=values.__getitem__)
        record[name] = {"max": round(values[largest], 1), "rank": largest}
    return record
STRAGGLER_RATIO = 1.5


def timing_record(per_rank: list[list[float]]) -> dict[str, Any]:
    """Each figure's min / median / max over the ranks and its slowest rank, and the ranks whose
    own work (data + compute) took at least 1.5x the median rank's (the lower median)."""
    record: dict[str, Any] = {}
    for column, name in enumerate(TIMING_NAMES):
        values = [rank_values[column] for rank_values in per_rank]
        slowest = max(range(len(values)), key=values.__getitem__)
        record[name] = {"min": round(min(values), 4), "median": round(statistics.median(values), 4),
                        "max": round(max(values), 4), "slowest_rank": slowest}
    work = [data + compute for data, compute, _ in per_rank]
    median = statistics.median_low(work)
    record["stragglers"] = {str(rank): round(w / median, 2) for rank, w in enumerate(work)
                            if median > 0 and w >= STRAGGLER_RATIO * median}
    if record["stragglers"]:  # the others waited this long for the slowest: goodput's waiting
        record["straggler_wait_s"] = round(max(work) - median, 4)
    return record


class RankTimings:
    """Where this rank's training time went since the last epoch record.

    ``data``: blocked waiting for batches. ``busy``: inside the step (forward, backward,
    optimizer), which includes waiting for the other ranks' gradients: that part is measured
    from the moment this rank's last gradient was ready (a post-accumulate-grad hook on the
    parameter that receives its gradient last, found at the first step) until backward
    returns. ``collectives``: that, plus the explicit collectives the watchdog timed.
    On CUDA the host times the launches: data time is real, the split of the rest is not.
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.data = self.busy = self.gradient_wait = 0.0
        self.last_grad_at: float | None = None
        self.order: list[int] = []
        self.handles = [p.register_post_accumulate_grad_hook(self._first_step_hook(i))
                        for i, p in enumerate(params) if p.requires_grad]
        self.params = params

    def _first_step_hook(self, index: int) -> Any:
        def hook(_: torch.Tensor) -> None:
            self.order.append(index)
            self.last_grad_at = time.perf_counter()
        return hook

    def _mark(self, _: torch.Tensor) -> None:
        self.last_grad_at = time.perf_counter()

    def backward_done(self) -> None:
        """Right after the backward that synchronises gradients."""
        if self.last_grad_at is not None:
            self.gradient_wait += time.perf_counter() - self.last_grad_at
            self.last_grad_at = None
        if self.order:  # after the first step: keep one hook, on the parameter that was last
            for handle in self.handles:
                handle.remove()
            self.handles = [self.params[self.order[-1]].register_post_accumulate_grad_hook(self._mark)]
            self.order = []

    def add_step(self, data_s: float, busy_s: float) -> None:
        self.data += data_s
        self.busy += busy_s

    def take(self, explicit_collectives_s: float) -> list[float]:
        """(data, compute, collectives) seconds, and start counting afresh."""
        figures = [self.data, max(0.0, self.busy - self.gradient_wait), self.gradient_wait + explicit_collectives_s]
        self.data = self.busy = self.gradient_wait = 0.0
        return figures
