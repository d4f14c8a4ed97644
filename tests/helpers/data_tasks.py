"""Test tasks for data at scale (issue 20): iterable streams, uneven shares, token files, the
JSONL example. Run inside real ranks; re-exported by ddptrain_test_tasks, whose names the tests
give as ``--task ddptrain_test_tasks:NAME``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ddptrain import Task
from ddptrain.tasks import regression_task
from ddptrain.tasks.regression import regression_data


class NumberStream(torch.utils.data.IterableDataset):
    """STREAM_SAMPLES samples ``(x, y, id)`` of the tutorial's regression, in an order shuffled per
    epoch, with torchdata's Stateful protocol: ``__iter__`` continues after ``load_state_dict``,
    starts afresh after ``set_epoch``."""

    def __init__(self, samples: int, seed: int = 0) -> None:
        data = regression_data(seed, samples)
        self.inputs, self.targets = data.tensors
        self.seed, self.epoch, self.position, self.resumed = seed, 0, 0, False

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self.resumed = epoch, 0, False

    def __iter__(self):
        order = torch.randperm(len(self.inputs), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        start = self.position if self.resumed else 0
        self.resumed = False
        for position in range(start, len(order)):
            self.position = position + 1
            k = int(order[position])
            yield self.inputs[k], self.targets[k], self.epoch * 1_000_000 + k  # which epoch read it, which sample

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.resumed = state["epoch"], state["position"], True


class StatelessNumberStream(torch.utils.data.IterableDataset):
    """The same stream without state: a resume reads the epoch again up to its position."""

    def __init__(self, samples: int, seed: int = 0) -> None:
        self.stream = NumberStream(samples, seed)

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __iter__(self):
        return iter(self.stream)


def _recorded_collate(samples):
    """Collate, and note which samples this batch holds (RECORD_DIR/ids-<pid>.txt: epoch x 10^6 + id)."""
    inputs, targets, ids = torch.utils.data.default_collate(samples)
    if "RECORD_DIR" in os.environ:
        with open(Path(os.environ["RECORD_DIR"]) / f"ids-{os.getpid()}.txt", "a") as handle:
            handle.write("".join(f"{i}\n" for i in ids.tolist()))
    return inputs, targets


def _stream_task(cfg, stream) -> Task:
    return Task(model=torch.nn.Linear(20, 1), train_set=stream, loss_fn=torch.nn.functional.mse_loss,
                collate_fn=_recorded_collate, defaults={"lr": 0.05, "optimizer": "sgd"})


def stream(cfg) -> Task:
    return _stream_task(cfg, NumberStream(int(os.environ.get("STREAM_SAMPLES", "250")), cfg.seed))


def stateless_stream(cfg) -> Task:
    return _stream_task(cfg, StatelessNumberStream(int(os.environ.get("STREAM_SAMPLES", "250")), cfg.seed))




class UnevenShares(torch.utils.data.IterableDataset):
    """Reads its share itself (``set_shard``): SHARE_LENGTHS samples for readers 0, 1, ..."""

    def __init__(self) -> None:
        self.lengths = [int(n) for n in os.environ.get("SHARE_LENGTHS", "100,130").split(",")]
        self.data = regression_data(0, sum(self.lengths))
        self.index = 0

    def set_shard(self, index: int, count: int) -> None:
        assert count == len(self.lengths), f"{count} readers for {len(self.lengths)} share lengths"
        self.index = index

    def __iter__(self):
        first = sum(self.lengths[:self.index])
        return (self.data[i] for i in range(first, first + self.lengths[self.index]))


def uneven_stream(cfg) -> Task:
    return Task(model=torch.nn.Linear(20, 1), train_set=UnevenShares(), loss_fn=torch.nn.functional.mse_loss)


class SquareShares(torch.utils.data.IterableDataset):
    """SQUARE_TOTAL samples ``(x, y, id)`` cut into reader shares in proportion to (i+1)²: with 4
    readers (2 ranks x 2 workers) 40, 160, 360 and 640 of 1,200, with 2 readers 240 and 960.
    Each reader reads its own share (``set_shard``), in an order shuffled per epoch, and keeps
    torchdata's Stateful protocol (``__iter__`` continues after ``load_state_dict``)."""

    def __init__(self, total: int) -> None:
        self.inputs, self.targets = regression_data(0, total).tensors
        self.index, self.count, self.epoch, self.position, self.resumed = 0, 1, 0, 0, False

    def set_shard(self, index: int, count: int) -> None:
        self.index, self.count = index, count

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self.resumed = epoch, 0, False

    def share(self) -> range:
        weights = [(i + 1) ** 2 for i in range(self.count)]
        bounds = [len(self.inputs) * sum(weights[:i]) // sum(weights) for i in range(self.count + 1)]
        return range(bounds[self.index], bounds[self.index + 1])

    def __iter__(self):
        share = self.share()
        order = torch.randperm(len(share), generator=torch.Generator().manual_seed(self.epoch * 100 + self.index))
        start = self.position if self.resumed else 0
        self.resumed = False
        for position in range(start, len(share)):
            self.position = position + 1
            k = share[int(order[position])]
            yield self.inputs[k], self.targets[k], self.epoch * 1_000_000 + k

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.resumed = state["epoch"], state["position"], True


class StatelessSquareShares(SquareShares):
    """The same shares without state: a resume reads each share again up to its position."""

    state_dict = None  # type: ignore[assignment]  # not Stateful: ddptrain checks for callables
    load_state_dict = None  # type: ignore[assignment]


def square_shares(cfg) -> Task:
    total = int(os.environ.get("SQUARE_TOTAL", "1200"))
    shares = StatelessSquareShares(total) if os.environ.get("STATELESS") else SquareShares(total)
    return _stream_task(cfg, shares)


class _FailingStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        raise FileNotFoundError("shard-00000.jsonl is missing")


class _EmptyStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


def empty_stream(cfg) -> Task:
    task = regression_task(cfg)
    task.train_set = _EmptyStream()
    return task


def failing_stream(cfg) -> Task:
    task = regression_task(cfg)
    task.train_set = _FailingStream()
    return task


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 256, width: int = 32) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens)))


def _next_token_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_file_lm(cfg) -> Task:
    """A tiny language model on TOKEN_FILE (uint16 ids below 256), windows of 64 tokens."""
    from ddptrain.data import TokenFile

    torch.manual_seed(cfg.seed)
    return Task(model=TinyLM(), train_set=TokenFile(os.environ["TOKEN_FILE"], seq_len=64),
                loss_fn=_next_token_loss, defaults={"lr": 0.1, "optimizer": "sgd"}, tokens_per_sample=64)


def jsonl_stream(cfg) -> Task:
    """examples/stream_jsonl.py's task: JSONL shards read by their own readers (set_shard), with state."""
    from stream_jsonl import stream_task

    return stream_task(cfg)



def write_jsonl_shards(folder: Path) -> None:
    from stream_jsonl import write_shards

    write_shards(folder)


class MisshapedStream(torch.utils.data.IterableDataset):
    """The regression samples ``(x, y)``, but item BAD_ITEM of each reader has 21 features, not 20."""

    def __init__(self, samples: int, seed: int, bad: int) -> None:
        self.inputs, self.targets = regression_data(seed, samples).tensors
        self.bad = bad

    def __iter__(self):
        for item, (x, y) in enumerate(zip(self.inputs, self.targets)):
            yield (torch.cat([x, x[:1]]) if item == self.bad else x), y


def misshaped_stream(cfg) -> Task:
    stream = MisshapedStream(256, cfg.seed, int(os.environ.get("BAD_ITEM", "37")))
    return Task(model=torch.nn.Linear(20, 1), train_set=stream, loss_fn=torch.nn.functional.mse_loss)
