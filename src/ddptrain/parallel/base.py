"""What every strategy shares: the blocks of a model, buffers shared from rank 0, state read
and written through torch.distributed.checkpoint's state dicts, autocast precision.

The strategies (``make_strategy`` in this package's ``__init__``):
- ``ddp`` (ddp.py): every rank holds the whole model; DDP all-reduces gradients in buckets
  during backward. Snapshots are one file written by rank 0.
- ``fsdp`` (fsdp.py): FSDP2's ``fully_shard`` on each block, then the root; each rank holds a
  shard of parameters, gradients and optimizer state. Snapshots are DCP folders.
Each imports this module only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..comm import DistContext, local_tensors
from ..errors import ConfigError
from ..random_states import capture_rng, restore_rng
from ..settings import ParallelSettings
from ..tasks.protocol import Task
from .averaging import WeightAverage
from .precision import autocast_dtype


def find_blocks(model: torch.nn.Module, task: Task) -> list[torch.nn.Module]:
    """The task's blocks, else the members of the model's largest ModuleList or Sequential."""
    if task.blocks is not None:
        return list(task.blocks(model))
    containers = [m for m in model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]
    if not containers:
        return []
    largest = max(containers, key=len)
    return [m for m in largest if any(True for _ in m.parameters())]


def move_to(module: torch.nn.Module, device: torch.device) -> None:
    """``module.to(device)``, unless all of it is there already: torch swaps each parameter of
    fake tensors (ddptrain plan --fake-tensors) even for a move to where it is, and fails."""
    held = [*module.parameters(), *module.buffers()]
    if any(tensor.device != device for tensor in held):
        module.to(device)


def checkpoint_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
    """Recompute each block's activations in backward (torch's checkpoint_wrapper, in place)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    wanted = {id(b) for b in blocks}
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in wanted)


@contextlib.contextmanager
def leaves_no_trace(module: torch.nn.Module) -> Iterator[None]:
    """Work that trains nothing must change nothing else either: buffers (BatchNorm's running
    statistics) as they were before it, and every random stream (torch's, CUDA's, Python's and
    numpy's, which dropout and a task's own noise draw from). For a stand-in micro-batch (weight 0,
    see data/), whose shape may be another rank's on a resume, and a restarted DDP process's
    settling backward (step.py), which the run it continues never ran."""
    saved, generators = [b.detach().clone() for b in module.buffers()], capture_rng()
    try:
        yield
    finally:
        restore_rng(generators)
        with torch.no_grad():
            for buffer, value in zip(module.buffers(), saved):
                buffer.copy_(value)


def convert_sync_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """``--sync-batchnorm``: BatchNorm layers normalise with the statistics of the global batch
    (torch's SyncBatchNorm, which runs on GPUs only: the Trainer refuses it on CPU)."""
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)


MMAP_THRESHOLD = 1 << 20  # bytes; glibc's M_MMAP_THRESHOLD is mallopt parameter -3


def return_large_buffers_to_os() -> None:
    """``--lean-cpu-memory``. CPU tensors come from glibc's malloc, which moves its mmap threshold up
    after the first large free; from then on large buffers freed in a step stay in the heap for
    reuse, and under fsdp the blocks gathered and freed every step fragment it (a 34M-parameter
    MLP's rank: 1.2 GB peak, against 0.55 GB with the threshold fixed at 1 MiB). A fixed
    threshold sends every large buffer to mmap, given back on free; the price is fresh, zeroed
    pages for every large allocation (about 1.4 ms per 4 MiB here): fsdp ran at about half its
    speed (README: FSDP). Process-wide, so set once per rank."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).mallopt(-3, MMAP_THRESHOLD) if name else None
    except (OSError, AttributeError):  # not glibc: its allocator, its rules
        pass


def replica_groups(parallel: ParallelSettings, ctx: DistContext) -> tuple[int, int]:
    """(groups, ranks per group) of --replicas (hsdp's groups, --sync's): one group per node
    unless --replicas says how many; consecutive ranks, so a group is a node by default.
    ConfigError when the count does not divide the ranks."""
    replicas = parallel.replicas or max(1, ctx.world_size // ctx.local_world_size)
    if ctx.world_size % replicas:
        raise ConfigError(f"--replicas {replicas} does not divide the {ctx.world_size} ranks into equal "
                          "groups; choose a divisor of the number of ranks")
    return replicas, ctx.world_size // replicas


def no_blocks_error(what: str) -> ConfigError:
    return ConfigError(f"{what} needs blocks: the model has no ModuleList or Sequential with parameters; "
                       "name them with Task.blocks = lambda model: [...]")


class Strategy:
    """The base: a replicated model whose state every rank holds whole."""

    snapshot_format = "file"  # one file by rank 0; "dcp": a folder every rank writes its shards to

    def __init__(self, parallel: ParallelSettings, ctx: DistContext, precision: str = "fp32",
                 torchft: bool = False) -> None:
        self.parallel, self.ctx, self.precision, self.torchft = parallel, ctx, precision, torchft
        # Whether this rank's gradients count in the gradient's norm: the ranks that do hold each
        # element once (ddp: rank 0's whole gradients; fsdp: every rank's shards; hsdp: the
        # shards of the first replica group).
        self.counts_gradients = ctx.is_main
        self.forward_syncs = False  # whether the forward pass itself holds a collective
        self.shares_buffers = False  # the model has buffers and other ranks to share them with
        self.settles_buckets = False  # a restarted process's first backward lays out DDP's buckets (step.py)
        if parallel.lean_cpu_memory and ctx.device.type == "cpu":
            return_large_buffers_to_os()

    def wrap(self, module: torch.nn.Module, task: Task) -> torch.nn.Module:
        raise NotImplementedError

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Accumulation micro-batches before the last: gradients stay local."""
        return contextlib.nullcontext()

    def check_gradients(self, module: torch.nn.Module) -> None:
        """After the first backward: ConfigError for gradients this strategy cannot do without."""

    def explain(self, error: RuntimeError, module: torch.nn.Module, step: int) -> Exception | None:
        """A clearer error for one the wrapped model raised in a step, or None."""
        return None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``--precision bf16|fp16`` as autocast around the forward pass and the loss."""
        dtype = autocast_dtype(self.precision)
        return torch.autocast(self.ctx.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def broadcast_buffers(self, module: torch.nn.Module) -> None:
        """Rank 0's buffers to every rank: one broadcast per dtype. (What DDP's own
        ``broadcast_buffers`` does at each synchronising forward; FSDP shares none.)"""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in module.buffers():
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        with torch.no_grad():
            for buffers in by_dtype.values():
                flat = _flatten_dense_tensors(buffers)
                dist.broadcast(flat, src=0)
                if not self.ctx.is_main:
                    for buffer, value in zip(buffers, _unflatten_dense_tensors(flat, buffers)):
                        buffer.copy_(value)

    def settle(self, module: torch.nn.Module) -> None:
        """Drop whatever the strategy gathered from the parameters (before they are swapped)."""

    # --- what the ranks' sums count ----------------------------------------------------------
    counts_data = True  # this rank's samples count in sums over ranks (--tp: a group's first rank's only)

    def data_context(self, ctx: DistContext) -> DistContext:
        """The rank and world the training and evaluation samples are shared over: every rank's
        own (--tp: a tensor-parallel group is one data-parallel rank)."""
        return ctx

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """--clip-grad: torch's clip_grad_norm_ over the whole model's gradients."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def counted_gradients(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's share of the gradients' squares, whose sum over the ranks is the norm's
        square (observe/metrics.GradNorms): ``counts_gradients``' ranks' local tensors."""
        return local_tensors(grads) if self.counts_gradients else []

    def eval_model(self, module: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
        """Evaluation runs the unwrapped module (no DDP hooks; sharded under fsdp, whose forward
        all-gathers, so every rank runs the same number of batches)."""
        return module

    # --- state ----------------------------------------------------------------------------
    # Every strategy speaks torch.distributed.checkpoint's state dicts: parameter names as
    # keys, the optimizer's state keyed by parameter name too. So a snapshot written under
    # one strategy (one file of whole tensors, or a DCP folder of shards) loads under another.
    def state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The model's and the optimizer's state (never called before the first step: see
        Checkpointer.wants; on a fresh optimizer torch initialises its state with a zero step)."""
        model_state, optimizer_state = get_state_dict(module, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                   whole: bool) -> None:
        """``whole``: the tensors are whole (a file snapshot), not shards (DCP loaded them into
        this run's own state dicts). On a replicated model both are this rank's tensors."""
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def full_model_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """model.pt: the whole model, CPU tensors, on rank 0 (None elsewhere)."""
        if not self.ctx.is_main:
            return None
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}


class ModelAndOptimizer:
    """The snapshot's ``model``, ``optimizer`` and (--ema) ``ema`` through a strategy: whole
    tensors or this rank's shards (what snapshots/checkpointer.Checkpointer calls ``weights``)."""

    def __init__(self, strategy: Strategy, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 average: WeightAverage | None = None) -> None:
        self.strategy, self.module, self.optimizer, self.average = strategy, module, optimizer, average

    def state_dict(self) -> dict[str, Any]:
        state = self.strategy.state(self.module, self.optimizer)
        return {**state, "ema": self.average.state_dict()} if self.average is not None else state

    def load_state_dict(self, state: dict[str, Any], whole: bool = True) -> None:
        self.strategy.load_state(self.module, self.optimizer, state, whole)
        if self.average is not None:
            self.average.load_state_dict(state.get("ema"), whole)
