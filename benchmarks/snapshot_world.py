"""What one snapshot costs a rank as the world grows: the bytes it sends and receives, and its CPU
time, at 2 to 16,384 ranks, simulated with torch's fake process group (plan/fake_group.py: one
process believes it is rank r of W; its collectives return at once and reach no one).

Side by side, for the same rank in the same process:
- **0.6**: every snapshot all-gathered every rank's pickled random states (a 64 KiB buffer per
  rank) to every rank, which unpickled all W of them. Its code is copied here (``gather_0_6``);
  the fake group moves no data, so each received buffer is filled with this rank's own payload,
  as the real all-gather would fill it with a peer's, before the W unpickles.
- **0.7**: ``Checkpointer.save`` itself (snapshots/checkpointer.py, a file snapshot of the
  tutorial's model, its write waited for): each rank writes its own part (snapshots/rank_parts.py)
  and the ranks meet in one barrier.

Bytes are the collectives' payloads as each rank holds them (counted as the plan counts them:
plan/collectives.CollectiveCount): an all-gather of n bytes from each of W ranks delivers (W - 1) x n to
each; a barrier carries no payload. CPU: this process's ``time.process_time`` over the snapshot,
the median of ``--reps``.

    python benchmarks/snapshot_world.py [--worlds 2,1024,4096,16384] [--reps 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RNG_CAPACITY = 1 << 16  # 0.6's fixed buffer per rank


def gather_0_6(world_size: int) -> None:
    """0.6's snapshots/rng.gather_rng_states, with each received buffer filled as a peer's would be."""
    import torch.distributed as dist

    from ddptrain.random_states import capture_rng

    payload = pickle.dumps(capture_rng())
    buffer = torch.zeros(RNG_CAPACITY, dtype=torch.uint8)
    buffer[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    buffer[8:8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [torch.empty_like(buffer) for _ in range(world_size)]
    dist.all_gather(gathered, buffer)
    for tensor in gathered:  # (what the peers would have sent)
        tensor.copy_(buffer)
    for tensor in gathered:
        size = int(tensor[:8].view(torch.int64).item())
        pickle.loads(tensor[8:8 + size].numpy().tobytes())


def checkpointer_for(world_size: int, rank: int, folder: Path) -> Any:
    """A Checkpointer of the tutorial's model as rank ``rank`` (DDP's file snapshots)."""
    from ddptrain.comm import CollectiveMarks, DistContext
    from ddptrain.run_dir import RunDir
    from ddptrain.settings import RunConfig
    from ddptrain.snapshots.checkpointer import Checkpointer

    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    class Weights:
        def state_dict(self) -> dict[str, Any]:
            return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

        def load_state_dict(self, state: dict[str, Any], whole: bool = True) -> None:
            raise NotImplementedError

    class FileFormat:
        snapshot_format = "file"

    class Progress:  # where the run is: the step the snapshot is taken after
        step = 0

        def state_dict(self) -> dict[str, Any]:
            return {"epoch": 0, "step_in_epoch": self.step, "global_step": self.step}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise NotImplementedError

    class SharedFolder(RunDir):
        def check_visible(self, path: Path, rank: int) -> None:
            """(Rank 0, which writes the snapshot file this rank would check for, is not in this process.)"""

    ctx = DistContext(rank, world_size, rank % 8, 8, torch.device("cpu"), "fake")
    recorded = {"batch_size": 32, "global_batch": 32 * world_size, "fingerprint": {}}
    return Checkpointer(RunConfig().snapshots, recorded, ctx, SharedFolder(folder), FileFormat(), CollectiveMarks(),
                        Weights(), states={"progress": Progress()})


def measure(world_size: int, rank: int, reps: int) -> dict[str, Any]:
    """(In a fresh process.) Both versions' bytes and CPU time for one snapshot of rank ``rank``."""
    from ddptrain.plan.collectives import CollectiveCount
    from ddptrain.plan.fake_group import as_rank

    figures: dict[str, Any] = {"world": world_size, "rank": rank}
    with as_rank(rank, world_size), tempfile.TemporaryDirectory() as folder:
        checkpointer = checkpointer_for(world_size, rank, Path(folder))
        progress = checkpointer.states["progress"]

        def save_0_7(step: int) -> None:
            progress.step = step
            checkpointer.save(step)

        for name, snapshot in (("0.6", lambda step: gather_0_6(world_size)), ("0.7", save_0_7)):
            times = []
            for step in range(1, reps + 2):
                counted = CollectiveCount()
                started = time.process_time()
                with counted:
                    snapshot(step)
                if checkpointer.writer is not None:
                    checkpointer.writer.wait()
                times.append(time.process_time() - started)
            received = sent = 0
            for (kind, elements, dtype, _), count in counted.found.items():
                payload = elements * dtype.itemsize * count
                if kind == "all_gather":  # (the first tensor of the output list: one rank's share)
                    sent, received = sent + payload, received + payload * (world_size - 1)
                elif kind != "barrier":
                    raise AssertionError(f"a collective this benchmark does not count: {kind}")
            parts = sorted(Path(folder, "snapshots").rglob(f"rank-{rank:05d}-*.pt"))
            figures[name] = {"sent": sent, "received": received, "cpu_s": statistics.median(times[1:]),
                             "collectives": {f"{kind}[{elements}]": count
                                             for (kind, elements, _, _), count in counted.found.items()},
                             "part_bytes": parts[-1].stat().st_size if parts and name == "0.7" else 0}
        checkpointer.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,1024,4096,16384")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    jobs = [(world, rank) for world in worlds for rank in sorted({0, world - 1})]
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:  # one at a time: CPU times apart
        rows = list(pool.map(measure, *zip(*jobs), [args.reps] * len(jobs)))
    print("One snapshot, per rank (fake process group; CPU: median of "
          f"{args.reps}, this machine's {multiprocessing.cpu_count()} cores)\n")
    print(f"{'world':>7} {'rank':>6} | {'0.6 recv MB':>11} {'sent KB':>8} {'CPU ms':>8} | {'0.7 recv':>8} "
          f"{'sent':>5} {'part KB':>8} {'CPU ms':>7} | {'CPU 0.6/0.7':>11}")
    for row in rows:
        old, new = row["0.6"], row["0.7"]
        print(f"{row['world']:>7,} {row['rank']:>6,} | {old['received'] / 1e6:>11.1f} {old['sent'] / 1e3:>8.1f} "
              f"{old['cpu_s'] * 1e3:>8.1f} | {new['received']:>8} {new['sent']:>5} {new['part_bytes'] / 1e3:>8.1f} "
              f"{new['cpu_s'] * 1e3:>7.2f} | {old['cpu_s'] / new['cpu_s']:>10.0f}x")
    first, last = (next(r for r in rows if r["world"] == w and r["rank"] == 0) for w in (worlds[0], worlds[-1]))
    grew = {version: last[version]["cpu_s"] / first[version]["cpu_s"] for version in ("0.6", "0.7")}
    print(f"\nrank 0's CPU per snapshot at {worlds[-1]:,} ranks / at {worlds[0]:,}: 0.6 {grew['0.6']:.0f}x, "
          f"0.7 {grew['0.7']:.2f}x (0.7 flat: each rank writes its own part; no collective carries one)")


if __name__ == "__main__":
    main()
