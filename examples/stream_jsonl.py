"""A stream of sharded JSONL files (the shape of most corpora past the tutorial) on ddptrain: an
``IterableDataset`` that reads only its own files, resumes exactly from a saved position, and
trains with DataLoader workers, counted in steps.

    python examples/stream_jsonl.py                       # writes 8 shards, trains 2 ranks x 2 workers
    python examples/stream_jsonl.py --max_steps 400       # (run it again: it resumes, or says it is done)

Each line is one sample, ``{"x": [20 numbers], "y": number}`` (the tutorial's regression). With
2 ranks and 2 workers each there are 4 readers; ``set_shard(index, count)`` gives reader i the
files i, i + 4, ... . ``state_dict()`` is where the reader stands (the file, the byte offset in
it): after a kill, the same command continues every reader from the snapshot's step, bitwise
as if nothing had happened (docs/data.md).
"""

import argparse
import json
import os
import random
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

import ddptrain


def shards_folder() -> Path:
    """Where the shards are: STREAM_JSONL_SHARDS, else examples/data/jsonl-shards."""
    return Path(os.environ.get("STREAM_JSONL_SHARDS", Path(__file__).resolve().parent / "data" / "jsonl-shards"))


def write_shards(folder: Path, shards: int = 8, lines_per_shard: int = 500, seed: int = 0) -> None:
    """The tutorial's data, y = x . w + noise, as ``shards`` JSONL files (skipped if present)."""
    if len(list(folder.glob("shard-*.jsonl"))) == shards:
        return
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    weights = [rng.gauss(0, 1) for _ in range(20)]
    for shard in range(shards):
        with open(folder / f"shard-{shard:05d}.jsonl", "w") as handle:
            for _ in range(lines_per_shard):
                x = [rng.random() for _ in range(20)]
                y = sum(a * b for a, b in zip(x, weights)) + rng.gauss(0, 0.1)
                handle.write(json.dumps({"x": x, "y": y}) + "\n")


class JsonlShards(IterableDataset):
    """Samples from JSONL files. Per epoch the files are read in an order shuffled with the
    epoch; each reader reads only its share of the files (``set_shard``)."""

    def __init__(self, folder: Path, seed: int = 0) -> None:
        self.files = sorted(folder.glob("shard-*.jsonl"))
        if not self.files:
            raise FileNotFoundError(f"no shard-*.jsonl in {folder}; python examples/stream_jsonl.py writes them")
        self.mine, self.seed = self.files, seed
        self.epoch, self.file, self.offset, self.resumed = 0, 0, 0, False

    def set_shard(self, index: int, count: int) -> None:
        self.mine = self.files[index::count]

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.file, self.offset, self.resumed = epoch, 0, 0, False

    def __iter__(self):
        order = list(self.mine)
        random.Random(self.seed + self.epoch).shuffle(order)
        first, offset = (self.file, self.offset) if self.resumed else (0, 0)
        self.resumed = False
        for index in range(first, len(order)):
            self.file = index
            with open(order[index], "rb") as handle:
                handle.seek(offset)
                for line in iter(handle.readline, b""):
                    self.offset = handle.tell()  # where the next sample starts: the state
                    record = json.loads(line)
                    yield torch.tensor(record["x"]), torch.tensor([record["y"]])
            self.file, self.offset = index + 1, 0
            offset = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "file": self.file, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.file, self.offset, self.resumed = state["epoch"], state["file"], state["offset"], True


def stream_task(cfg: ddptrain.RunConfig) -> ddptrain.Task:
    return ddptrain.Task(model=torch.nn.Linear(20, 1), train_set=JsonlShards(shards_folder(), cfg.seed),
                         loss_fn=torch.nn.functional.mse_loss, defaults={"lr": 0.05})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="train on a stream of sharded JSONL files")
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--run_dir", default="runs/stream_jsonl")
    args = parser.parse_args()
    write_shards(shards_folder())
    summary = ddptrain.fit(stream_task, max_steps=args.max_steps, workers=args.workers, batch_size=16,
                           run_dir=args.run_dir, save_every=50)
    if summary:
        print(f"{summary['steps']} steps, train loss {summary['train_loss']:.4f}")
