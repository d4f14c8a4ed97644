"""Iterable training sets (``torch.utils.data.IterableDataset``): streams and files read in order.

**Shares.** Every DataLoader worker of every rank reads a disjoint share of the stream. With W
ranks and K workers per rank (K = 1 without workers) there are W*K readers; reader
``g = rank * K + worker`` takes the stream's items g, g + W*K, g + 2*W*K, ... A data set that
can read its share itself (skipping what is not its own without reading it: the files of a
shard, say) defines ``set_shard(index, count)``; ddptrain then calls it in each reader and
yields everything it gives. Before each epoch the data set's ``set_epoch(epoch)``, if it has
one, is called (reshuffle there, as DistributedSampler's epochs do).

**Uneven ends never hang.** Before each optimizer step the ranks add up how many samples each
holds for it (one all-reduce of a few numbers, on the CPU group): a rank whose share ran out
takes the step with stand-in micro-batches of weight 0 (as a map-style set's short last step
does), and the epoch ends, for every rank at the same step, when no rank holds a sample. So
every sample of the stream trains once per epoch and a step's gradient is the mean over the
samples really in it. (A rank that never had a batch gets its stand-in from the lowest rank
that has one, once.)

**Exact resume.** Batches come from torchdata's ``StatefulDataLoader``, which records, with
every batch it hands over, the state of the reader (or readers, with ``--workers``) that made
it. Each rank's loader state goes into every snapshot; the same command resumes each reader
where the snapshot's step left it. A data set with ``state_dict()`` / ``load_state_dict()``
(torchdata's Stateful protocol; after ``load_state_dict`` its ``__iter__`` continues from the
state, after ``set_epoch`` it starts the epoch afresh) resumes at once; one without is read
again from the epoch's start up to its position (slower, still exact). The shares depend on
the number of ranks and workers, so a stream resumes only on the world size and ``--workers``
it was saved with.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from ..comm import CollectiveMarks, broadcast_object
from ..errors import ConfigError
from .batches import ExplainedCollate, to_device
from .sampling import MicroBatch
from .workers import settle_before_fork

AGREEING = "agreeing on the step's sample counts (an iterable training set)"


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def reader_share(rank: int, world_size: int) -> tuple[int, int]:
    """This reader's share of the stream, ``(index, count)`` (see the module docstring)."""
    info = get_worker_info()
    workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
    return rank * workers + worker, world_size * workers


def samples_in(batch: Any) -> int:
    """How many samples a collated batch holds: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        return samples_in(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return samples_in(batch[0]) if batch and not isinstance(batch[0], (str, bytes, int, float)) else len(batch)
    raise ConfigError(f"cannot count the samples of a {type(batch).__name__} batch from the training stream; "
                      "batch into tensors, tuples, lists or dicts of them (or give Task.collate_fn)")


class StreamShare(IterableDataset):
    """One reader's share of ``stream`` (the DataLoader pickles one into each worker)."""

    def __init__(self, stream: IterableDataset, rank: int, world_size: int) -> None:
        self.stream, self.rank, self.world_size = stream, rank, world_size
        self.position = 0  # items of the whole stream this reader has gone through this epoch
        self.resumed = False

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.stream, "set_epoch"):
            self.stream.set_epoch(epoch)
        self.position, self.resumed = 0, False

    def __iter__(self) -> Iterator[Any]:
        index, count = reader_share(self.rank, self.world_size)
        if hasattr(self.stream, "set_shard"):  # the data set reads its share itself
            self.stream.set_shard(index, count)
            yield from self.stream
            return
        start = self.position if self.resumed else 0
        self.resumed = False
        for position, item in enumerate(self.stream, start=start):
            self.position = position + 1
            if position % count == index:
                yield item


class StatefulStreamShare(StreamShare):
    """A share of a stream that has ``state_dict()`` / ``load_state_dict()``: its state, and
    where this reader stands in it, travel with every batch (StatefulDataLoader's protocol)."""

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "position": self.position}  # type: ignore[attr-defined]  # StatefulStreamShare: the stream is Stateful

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])  # type: ignore[attr-defined]  # likewise
        self.position, self.resumed = state["position"], True


class StreamBatches:
    """This rank's optimizer steps of one epoch of an iterable set, agreed with every rank: each
    a list of ``grad_accum`` ``(batch, MicroBatch)`` pairs, the batches on the device."""

    steps_per_epoch = None  # known only when the stream ends

    def __init__(self, stream: IterableDataset, rank: int, world_size: int, batch_size: int, grad_accum: int,
                 device: torch.device, workers: int = 0, collate_fn: Callable[..., Any] | None = None,
                 seed: int = 0, group: Any = None, marks: CollectiveMarks | None = None) -> None:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError:
            raise ConfigError("an iterable training set needs torchdata's StatefulDataLoader (exact resume); "
                              "pip install 'ddptrain[data]' (torchdata)") from None
        # ddptrain says once itself that a stream without state resumes by reading again.
        logging.getLogger("torchdata.stateful_dataloader.stateful_dataloader").setLevel(logging.ERROR)
        self.rank, self.world_size, self.grad_accum, self.device = rank, world_size, grad_accum, device
        self.workers, self.seed, self.group, self.marks = workers, seed, group, marks or CollectiveMarks()
        self.stateful = is_stateful(stream)
        self.share = (StatefulStreamShare if self.stateful else StreamShare)(stream, rank, world_size)
        self.generator = torch.Generator()  # the workers' seeds: the loader's own (see batches._Batches)
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            self.loader = StatefulDataLoader(self.share, batch_size=batch_size, num_workers=workers,
                                             collate_fn=ExplainedCollate(collate_fn),
                                             pin_memory=device.type == "cuda",
                                             generator=self.generator)
        self.saved: dict[str, Any] | None = None  # this rank's loader state, for the epoch it was taken in
        self.saved_world_size = world_size
        self.stand_in: Any = None  # a batch to run with weight 0 when this rank's share has run out
        self.stand_ins_shared = False  # every rank holds a stand-in: agreements can overlap the steps
        self.read_any = False  # whether this rank's share ever gave a batch (its iterator works)
        self.exhausted = False  # this rank's share ran out this epoch: only stand-ins until it ends
        self.full_step = world_size * grad_accum * batch_size  # what each micro-batch is weighted as a part of
        self.message, self.total = torch.zeros(1, dtype=torch.float64), -1
        self.pending: Any = None  # the overlapped agreement's work, read after the backward

    # --- state (in each rank's part of a snapshot) -------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # A finished loader's state restores as a fresh one (torchdata starts the stream over,
        # with workers): a share that ran out is said so, and stays out after a resume.
        return {"workers": self.workers, "loader": self.loader.state_dict(), "exhausted": self.exhausted}

    def load_state_dict(self, saved: dict[str, Any] | None, saved_world_size: int) -> None:
        """This rank's saved state (its part of the snapshot; on another world size rank 0's, or
        None), used if the run resumes inside an epoch (at an epoch's start, any world size reads
        the stream anew)."""
        self.saved, self.saved_world_size = saved or {}, saved_world_size

    # --- the epoch ------------------------------------------------------------------------
    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Begin ``epoch`` at optimizer step ``start_step``: a resumed epoch continues from the
        snapshot's loader state, a new one from the stream's start."""
        self.share.set_epoch(epoch)
        self.generator.manual_seed(self.seed * 1_000_003 + epoch)
        resumed = self._saved_loader_state() if start_step > 0 and self.saved is not None else {}
        self.exhausted = bool(resumed.get("exhausted", False))
        self.loader.load_state_dict({} if self.exhausted else resumed.get("loader", {}))
        self.saved = None

    def _saved_loader_state(self) -> dict[str, Any]:
        mine = self.saved or {}
        if not mine and self.saved_world_size == self.world_size:
            raise ConfigError(f"the snapshot stopped inside an epoch of an iterable training set, and holds no "
                              f"reading position for rank {self.rank} (its part is missing): resume from a "
                              "snapshot at an epoch's end, or one with every rank's part")
        saved = (self.saved_world_size, mine.get("workers"))
        if saved != (self.world_size, self.workers):
            workers = f"--workers {saved[1]}" if saved[1] is not None else "its --workers"
            raise ConfigError(f"the snapshot stopped inside an epoch of an iterable training set read by "
                              f"{saved[0]} rank(s) x {workers}; this run has {self.world_size} x "
                              f"{self.workers}, and a stream's shares depend on both: resume with the same "
                              "world size and --workers (or resume from a snapshot at an epoch's end)")
        return mine

    def steps(self) -> Iterator[list[tuple[Any, MicroBatch]]]:
        """The epoch's remaining optimizer steps, ending on every rank at the same step. Each
        step's micro-batches are weighted as parts of a full step (``full_step`` samples); the
        Trainer calls ``agreed_samples`` after the backward for the step's real count (0: the
        epoch was over, nothing to step) and rescales a short step's gradients."""
        if self.workers:
            settle_before_fork()  # the epoch's iterator forks its workers
        batches = iter(()) if self.exhausted else iter(self.loader)
        while True:
            mine = self._fetch(batches)
            counts = [samples_in(batch) for batch in mine]
            if self.stand_ins_shared:
                self._start_agreement(sum(counts))  # read after the step's backward: overlapped
            elif self._agree(sum(counts), mine) == 0:  # at once: a rank may need a stand-in first
                return
            group = [(to_device(batch, self.device, self.device.type == "cuda"),
                      MicroBatch(None, count, self.full_step, self.world_size)) for batch, count in zip(mine, counts)]
            stand_in = (self.stand_in, MicroBatch(None, 0, self.full_step, self.world_size))
            yield group + [stand_in] * (self.grad_accum - len(mine))
            if self.total == 0:
                return

    def agreed_samples(self) -> int:
        """The samples in the step just taken, over every rank (0: no rank had any)."""
        if self.pending is not None:
            with self.marks.waiting(AGREEING):
                self.pending.wait()
            self.total, self.pending = int(self.message[0]), None
        return self.total

    def _start_agreement(self, count: int) -> None:
        self.message = torch.tensor([float(count)], dtype=torch.float64)
        if self.world_size == 1:
            self.total = count
            return
        self.pending = dist.all_reduce(self.message, group=self.group, async_op=True)

    def _fetch(self, batches: Iterator[Any]) -> list[Any]:
        """Up to ``grad_accum`` batches of this rank's share (fewer, or none, where it ends). An
        iterator that fails before giving anything is a one-line error naming the rank."""
        if self.exhausted:
            return []
        try:
            mine = list(itertools.islice(batches, self.grad_accum))
            self.exhausted = len(mine) < self.grad_accum
        except Exception as error:
            if self.read_any:
                raise
            # From a worker, the message holds the worker's traceback: its last line is the error.
            lines = str(error).strip().splitlines()
            what = (lines[-1] if lines else "").removeprefix(f"{type(error).__name__}: ")
            raise ConfigError(f"rank {self.rank}: the training set's iterator failed before its first batch: "
                              f"{type(error).__name__}: {what}") from None
        if mine:
            self.read_any = True
            if self.stand_in is None:
                self.stand_in = to_device(mine[0], self.device)
        return mine

    def _agree(self, count: int, mine: list[Any]) -> int:
        """At once: the step's samples over every rank (0: the epoch is over), and a stand-in for
        every rank that has no batch of its own yet, from the lowest rank that has one. Done
        until one step has samples: from then on every rank holds a stand-in."""
        needs = self.stand_in is None and len(mine) < self.grad_accum
        if self.world_size == 1:
            self.total = count
        else:
            message = torch.zeros(2 + self.world_size, dtype=torch.float64)
            message[0], message[1], message[2 + self.rank] = count, float(needs), float(bool(mine))
            with self.marks.waiting(AGREEING):
                dist.all_reduce(message, group=self.group)
            self.total, needed, holders = int(message[0]), message[1] > 0, message[2:].nonzero()
            if self.total and needed:
                source = int(holders[0])
                with self.marks.waiting("sharing a stand-in batch (a rank's stream share ran out)"):
                    received = broadcast_object(mine[0] if self.rank == source else None, src=source,
                                                group=self.group)
                if self.stand_in is None:
                    self.stand_in = to_device(received, self.device)
        self.stand_ins_shared = self.total > 0
        return self.total
