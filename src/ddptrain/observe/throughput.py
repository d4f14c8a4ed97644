"""Throughput in the units runs are compared by: samples/s, tokens/s, TFLOP/s and MFU.

FLOPs are counted once, on the first optimizer step, with torch's own
``torch.utils.flop_counter.FlopCounterMode`` (forward and backward of every micro-batch of
the step, on this rank): after that a step costs what the first one did, for the same batch
shapes. The job's FLOPs per step are the ranks' counts added (one small all-reduce, once).
Achieved TFLOP/s = FLOPs per step x steps / seconds; MFU = that / (the peak of one device x
the number of ranks). The peak is the device's dense bf16 peak (torchtitan's convention) from
``PEAK_TFLOPS`` when torch names a GPU listed there, or ``--peak-tflops``; on CPU, only the
latter. Tokens: ``Task.tokens_per_sample`` (e.g. a language model's sequence length).

``--profile N`` records steps 2 to N+1 (the first step, with its one-off costs, is left
out) with ``torch.profiler`` and writes one Chrome / Perfetto trace per rank to
``RUN_DIR/profile/rank-R.json``.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

# Dense bf16 TFLOP/s of one device, as vendors state them (SXM parts where there are two).
PEAK_TFLOPS = {
    "H200": 989.0, "H100": 989.0, "H100 PCIE": 756.0, "H800": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0,
    "A800": 312.0, "L40S": 362.0, "L40": 181.0, "L4": 121.0, "A10G": 70.0, "A10": 125.0, "V100": 125.0,
    "T4": 65.0, "MI300X": 1307.0, "MI250X": 383.0,
}


def device_peak_tflops(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device`` when it is a GPU this table knows, else None."""
    return peak_tflops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_tflops_of(device_name: str) -> float | None:
    """PEAK_TFLOPS of the model a device's name (``torch.cuda.get_device_name``) names, else None."""
    name = device_name.upper()
    for model in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIE" before "H100", "L40S" before "L40"
        if model in name:
            return PEAK_TFLOPS[model]
    return None


class FlopCount:
    """This rank's FLOPs of one optimizer step, counted on the first step it is asked to.

    Counting runs that step under torch's FlopCounterMode, whose dispatch changes the rounding of
    some models' gradients (a transformer block's: its backward's sums in another order). A run
    resumed from a snapshot would count again on its first step and so compute that step unlike
    the uninterrupted run: the count is kept in each rank's part of the snapshot (a ``PerRank``
    state, snapshots/checkpointer.py) and taken back on the same world size, so only a run's
    first step ever runs under the counter."""

    def __init__(self, world_size: int = 1) -> None:
        self.per_step: int | None = None  # this rank's
        self.world_size = world_size
        self._mode: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"per_step": self.per_step}

    def load_state_dict(self, saved: dict[str, Any] | None, saved_world_size: int) -> None:
        """This rank's count from the snapshot (on another world size its batch differs: counted again)."""
        if saved is not None and saved_world_size == self.world_size:
            self.per_step = saved.get("per_step")

    @contextlib.contextmanager
    def first_step(self) -> Any:
        """Around a step's forward and backward: counts them the first time, nothing after."""
        if self.per_step is not None:
            yield
            return
        with _local_flop_counter() as mode, warnings.catch_warnings():
            # The counter tracks modules with global hooks for this one step; torch.compile, met
            # compiling its first forward here, warns that global hooks fire twice: not ours to fix.
            warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
            yield
        self.per_step = int(mode.get_total_flops())


def _local_flop_counter() -> Any:
    """torch's FlopCounterMode counting this rank's own FLOPs. A dispatch mode sees an op on
    DTensors (--tp's split layers) before DTensor turns it into the op on this rank's parts, so
    torch's counter counts the whole layer's arithmetic on every rank of its group (a 2-way
    split model counted 97% of its unsplit FLOPs per rank). Each such op counts as the share of
    it this rank computes: its most split input's (a column-wise layer's weight, a row-wise
    layer's weight and input: 1/N of the layer's; replicated inputs: all of it)."""
    from torch.utils.flop_counter import FlopCounterMode

    class LocalFlopCounter(FlopCounterMode):
        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            # (torch's own five lines, the count scaled)
            if func_packet in self.flop_registry:
                flops = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
                flops = round(flops * _local_share(args, kwargs))
                for parent in set(self.mod_tracker.parents):
                    self.flop_counts[parent][func_packet] += flops
            return out

    return LocalFlopCounter(display=False, custom_mapping=_cpu_attention())


def _local_share(args: Any, kwargs: Any) -> float:
    """The smallest share of a DTensor argument this rank holds (1: no DTensor among them)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    shares = [t.to_local().numel() / t.numel() for t in tree_leaves((args, kwargs))
              if isinstance(t, DTensor) and t.numel()]
    return min(shares, default=1.0)


def _cpu_attention() -> dict[Any, Any]:
    """torch's FLOP counter has formulas for scaled_dot_product_attention's CUDA kernels (flash,
    memory-efficient, cuDNN) but not for its CPU kernel: there attention counted nothing (a GPT's
    FLOPs 7.7% short of nanoGPT's formula). The CPU kernel's, forward and backward, by the same
    formulas, so a step counts the same FLOPs on either device."""
    import inspect

    from torch.utils import flop_counter

    aten = torch.ops.aten  # (the formulas as written, unwrapped: the counter wraps them to take shapes)
    return {aten._scaled_dot_product_flash_attention_for_cpu: inspect.unwrap(flop_counter.sdpa_flop),
            aten._scaled_dot_product_flash_attention_for_cpu_backward: inspect.unwrap(flop_counter.sdpa_backward_flop)}


class TrainingClock:
    """Seconds of training alone: the wall clock less the time spent ``aside`` (evaluations,
    snapshots), so that rates compare with another trainer's steady rate whatever the run
    evaluates or saves in between. (On a GPU an evaluation's first read also waits for the
    training work still queued: that moment counts as the evaluation's.)"""

    def __init__(self) -> None:
        self.aside_s = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.aside_s

    @contextlib.contextmanager
    def aside(self) -> Any:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.aside_s += time.perf_counter() - began


def throughput_record(samples: int, seconds: float, steps: int, job_flops_per_step: float | None,
                      tokens_per_sample: int | None, peak_tflops: float | None, world_size: int) -> dict[str, Any]:
    """An epoch's or a step record's throughput figures (``samples`` and ``steps`` over ``seconds``)."""
    record: dict[str, Any] = {}
    if seconds <= 0:
        return record
    if tokens_per_sample:
        record["tokens_per_s"] = round(samples * tokens_per_sample / seconds, 1)
    if job_flops_per_step:
        achieved = job_flops_per_step * steps / seconds / 1e12
        record["tflops"] = float(f"{achieved:.3g}")  # 3 significant digits: a small model's too
        if peak_tflops:
            record["mfu"] = float(f"{achieved / (peak_tflops * world_size):.3g}")
    return record


class StepProfiler:
    """``--profile N``: torch.profiler over steps 2..N+1, one trace per rank into the run dir."""

    def __init__(self, steps: int, run_dir: Path, rank: int, device: torch.device) -> None:
        self.steps, self.device, self.path = steps, device, run_dir / "profile" / f"rank-{rank}.json"
        self.profiler: Any = None

    def start(self) -> None:
        if self.steps <= 0:
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        # Kineto prints "USDT: ... profiler_start/stop" at its highest level (5) on every rank: above it,
        # the console stays the run's (read when the profiler first starts; the user's setting wins).
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        # The first step is the warm-up, never recorded (torch warns of a schedule without one).
        self.profiler = profile(activities=activities, on_trace_ready=self._write,
                                schedule=schedule(wait=0, warmup=1, active=self.steps, repeat=1),
                                record_shapes=True)  # the shapes tell collectives apart (tests/helpers/costs.py)
        self.profiler.start()

    def step_done(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def _write(self, profiler: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
