"""Snapshot files: atomic writes, validated loads, rotation. No snapshot is lost or half-written.

(What to save and when is checkpointer.py's business; where a run resumes, restore.py's.)

A snapshot is written to a hidden temporary file in the same folder, flushed, fsynced,
renamed over its final name with ``os.replace`` (atomic on POSIX), and the folder is fsynced
so the rename survives a power cut. Only then are snapshots beyond ``--keep`` removed.
Loading never unpickles code (``weights_only=True``) and checks the schema; a broken newest
file is skipped with a warning in favour of the previous complete one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Any

import torch

from ..errors import DiskFull, SnapshotError
from ..exits import finish_before_exit
from ..run_dir import SNAPSHOT_NAME, snapshot_name, snapshot_number
from ..settings.fingerprint import fingerprint_changes

FORMAT_VERSION = 3  # 3: each rank's random states in a part of its own (rank_parts.py), not the metadata
READABLE_VERSIONS = (2, 3)
# After a failure, how long rank 0 lets the snapshot write in flight finish before its process ends:
# that snapshot was taken before the failure (a non-finite loss is caught before the next save), and
# the error names it as the last good one. A local file: no peer is waited for.
FAILED_WRITE_WAIT_S = 30.0
REQUIRED = {
    "format_version": int, "progress": dict, "world_size": int, "batch_size": int, "global_batch": int,
    "fingerprint": dict,
}
REQUIRED_IN_VERSION_2 = {"rng": list}  # every rank's random states, gathered (from 3: in the ranks' parts)
WEIGHTS = {"model": dict, "optimizer": dict}  # in a file; a DCP folder holds them as shards
PROGRESS = ("epoch", "step_in_epoch", "global_step")


def snapshot_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "snapshots"


def snapshot_step(path: Path) -> int:
    return snapshot_number(path.name)


def list_snapshots(directory: Path) -> list[Path]:
    """Complete snapshots (files and DCP folders), oldest first. Temporary files (``.*.tmp``)
    and unfinished folders (``.*.partial``) never appear here."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if (m := SNAPSHOT_NAME.match(p.name)) and (p.is_dir() != bool(m.group(2)))]
    return sorted(found, key=snapshot_step)


def rotate(directory: Path, keep: int, spare: Collection[str] = ()) -> None:
    """Remove all but the newest ``keep`` snapshots (only ever after a new one is committed), a
    file's ranks' parts with it (rank_parts.py), and parts older than the newest kept snapshot whose
    file was never committed; ``spare``: names kept whatever their age (a run dir on a store:
    those not uploaded yet)."""
    found = list_snapshots(directory)
    for old in found[:-keep]:
        if old.name in spare:
            continue
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
            shutil.rmtree(old.with_name(f"{old.stem}.ranks"), ignore_errors=True)
    oldest_kept = snapshot_step(found[-keep:][0]) if found else -1
    for orphan in directory.glob("step-*.ranks"):  # (a run stopped between its parts and its file)
        step = int(orphan.name.split("-")[1].split(".")[0])
        if step < oldest_kept and not (directory / snapshot_name(step)).exists() and \
                snapshot_name(step) not in spare:
            shutil.rmtree(orphan, ignore_errors=True)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` that leaves either the old file or the complete new one, never a part; a
    disk that fills up meanwhile is ``DiskFull`` (one line), not torch's writer's message."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if not room_for(state_bytes(obj), path.parent):  # refused before the disk is filled: a snapshot
        # written into the last free bytes failed the run's other writers meanwhile (its records, the
        # ranks' error reports, seen as a torch traceback where this line belonged)
        raise disk_full(path, state_bytes(obj))
    try:
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if out_of_space(error, path.parent):
            raise disk_full(path, state_bytes(obj)) from None
        raise
    fsync_dir(path.parent)


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
LOW_SPACE = 4 << 20  # bytes: a failed write with less than this free is taken for a full disk


def room_for(size: int, folder: Path) -> bool:
    """Whether ``folder``'s file system says it has ``size`` bytes free; True where it says nothing
    of use (a total of 0: some FUSE mounts report no sizes), so a write is only refused on a disk
    known to be too full."""
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return True
    return usage.total == 0 or usage.free >= size


def out_of_space(error: BaseException, folder: Path) -> bool:
    """Whether a failed write failed for lack of space: the OS said so, or torch's zip writer
    reported a short write (\"unexpected pos ...\", its errno lost) on a disk that is nearly full."""
    if isinstance(error, OSError) and error.errno in NO_SPACE:
        return True
    if not isinstance(error, (OSError, RuntimeError)):
        return False
    try:
        return shutil.disk_usage(folder).free < LOW_SPACE
    except OSError:
        return False


def disk_full(path: Path, needed: int) -> DiskFull:
    """The one line for a write of ``path`` that found no space (``needed``: about what it takes)."""
    folder = path.parent
    run_dir = folder.parent if folder.name == "snapshots" else folder
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.1f} MB free"
    except OSError:
        free = "free space unknown"
    kept = list_snapshots(snapshot_dir(run_dir))
    intact = (f"the newest complete snapshot, {kept[-1].name}, is intact" if kept else "no snapshot was written yet")
    return DiskFull(f"no space left in {run_dir} writing {path.name} ({free}; it takes about "
                    f"{needed / 2**20:.1f} MB); {intact}: free space there (or lower --keep) and run the same "
                    "command to resume")


def snapshot_estimate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, averaged: bool = False) -> int:
    """About the bytes of one snapshot, before the optimizer has any state: the weights, plus the
    optimizer's per-parameter tensors (Adam-like: two; SGD: its momentum, if any), plus the
    weights' average (``averaged``: --ema)."""
    weights = state_bytes(dict(model.state_dict()))
    name = type(optimizer).__name__
    if name == "SGD":
        slots = 1 if any(group.get("momentum", 0) for group in optimizer.param_groups) else 0
    else:
        slots = 2
    return weights * (1 + slots + averaged)


def space_warning(run_dir: Path, snapshot: int, keep: int) -> str | None:
    """A warning when ``run_dir``'s disk cannot hold ``keep`` snapshots and the one being written."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return None
    needed = (keep + 1) * snapshot
    if free >= needed:
        return None
    return (f"warning: {run_dir} has {free / 2**20:.1f} MB free; --keep {keep} snapshots and the one being "
            f"written need about {needed / 2**20:.1f} MB ({snapshot / 2**20:.1f} MB each): the run will stop when "
            "the disk is full; free space or lower --keep")


def state_bytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` (dicts, lists and tuples followed): about its file's size."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


HF_MODEL = "hf_model.json"  # what `export --format hf` rebuilds the model from, without the task


def hf_model_description(module: torch.nn.Module) -> dict[str, Any] | None:
    """A transformers model's class and config (``save_pretrained``'s config.json), else None.
    A PEFT model (LoRA): its base model's, and each adapter's config under ``peft``."""
    peft_configs, get_base = getattr(module, "peft_config", None), getattr(module, "get_base_model", None)
    if isinstance(peft_configs, dict) and callable(get_base):
        base = hf_model_description(get_base())
        if base is None:
            return None
        return {**base, "peft": {name: config.to_dict() for name, config in peft_configs.items()}}
    config = getattr(module, "config", None)
    # fully_shard gives the module a class of its own (FSDPGPT2LMHeadModel): the transformers one is its base
    cls = next((c for c in type(module).__mro__ if c.__module__.startswith("transformers.models.")), None)
    if cls is None or not hasattr(config, "to_dict"):
        return None
    return {"class": cls.__name__, "config": config.to_dict()}  # type: ignore[union-attr]  # checked


def _json_value(value: Any) -> Any:
    """json's fallback: sets (PEFT's target_modules) as sorted lists, anything else as text."""
    return sorted(value) if isinstance(value, (set, frozenset)) else str(value)


def write_hf_model(module: torch.nn.Module, run_dir: Path) -> bool:
    """``hf_model.json`` beside model.pt for a transformers model; whether one was written."""
    description = hf_model_description(module)
    if description is None:
        return False
    tmp = run_dir / f".{HF_MODEL}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(description, default=_json_value) + "\n")
    os.replace(tmp, run_dir / HF_MODEL)
    return True


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_snapshot(state: dict[str, Any], directory: Path, keep: int, spare: Collection[str] = ()) -> Path:
    """Commit ``state`` as the newest snapshot, then rotate (sparing ``spare``). Call on one rank only."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(".*.tmp"):  # left by a writer that was killed
        stale.unlink(missing_ok=True)
    path = directory / snapshot_name(state["progress"]["global_step"])
    atomic_save(state, path)
    rotate(directory, keep, spare)
    return path


def cpu_copy(obj: Any, copy: bool = True) -> Any:
    """``obj`` with every tensor replaced by a CPU copy (dicts, lists and tuples followed);
    ``copy=False``: tensors already on the CPU are kept as they are (nothing will change them)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: cpu_copy(v, copy) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v, copy) for v in obj)
    return obj


class BackgroundWrite:
    """The one write in flight (a future); its error surfaces on ``wait``."""

    pending: Future[Any] | None = None
    spare: frozenset[str] = frozenset()  # snapshots --keep never removes (a warmup-stable-decay's before its decay)

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()


class SnapshotWriter(BackgroundWrite):
    """One background thread that commits snapshot files in order (and, for a run dir on a
    store, queues each for upload: ``uploads``, an uploads.Uploader)."""

    def __init__(self, uploads: Any = None) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddptrain-snapshot")
        self.uploads = uploads

    def submit(self, state: dict[str, Any], directory: Path, keep: int) -> None:
        self.wait()
        self.pending = self.pool.submit(self._write, state, directory, keep)
        finish_before_exit(self.pending, FAILED_WRITE_WAIT_S)  # (an exit after a failure waits for it)

    def _write(self, state: dict[str, Any], directory: Path, keep: int) -> Path:
        if self.uploads is None:
            return write_snapshot(state, directory, keep, spare=self.spare)
        path = write_snapshot(state, directory, keep, spare=self.spare | set(self.uploads.pending_snapshots()))
        self.uploads.add_snapshot(path.name)
        return path

    def close(self, wait: bool = True) -> None:
        """Finish the write in flight; after a failure (not ``wait``) for FAILED_WRITE_WAIT_S at
        most, its error ignored, and a write still going is left to the process's end (a
        half-written temporary file is never a snapshot, and the next writer removes it).
        (Left at once, a step's snapshot was lost under load when the steps after it met a NaN.)"""
        if not wait:
            pending, self.pending = self.pending, None
            self.pool.shutdown(wait=False, cancel_futures=True)
            if pending is not None:
                wait_for([pending], timeout=FAILED_WRITE_WAIT_S)
            return
        try:
            self.wait()
        finally:
            self.pool.shutdown(wait=True)


def load_snapshot(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and validate one snapshot (of a DCP folder, its meta.pt: the shards are loaded
    later, into the model); SnapshotError (one line) when it cannot be used."""
    folder = path.is_dir()
    try:
        state = torch.load(path / "meta.pt" if folder else path, map_location=map_location, weights_only=True)
    except Exception as error:  # truncated, empty, not a zip, or a pickle weights_only refuses
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SnapshotError(f"snapshot {path} cannot be read ({first_line[:200]})") from None
    if not isinstance(state, dict):
        raise SnapshotError(f"snapshot {path} is not a ddptrain snapshot (holds {type(state).__name__})")
    version = state.get("format_version")
    if isinstance(version, int) and version not in READABLE_VERSIONS:
        raise SnapshotError(f"snapshot {path} has format version {version}; this ddptrain reads versions "
                            f"{' and '.join(map(str, READABLE_VERSIONS))}; use --resume never or another --run-dir")
    old_format = REQUIRED_IN_VERSION_2 if version == 2 else {}
    for key, kind in {**REQUIRED, **old_format, **({} if folder else WEIGHTS)}.items():
        if not isinstance(state.get(key), kind):
            raise SnapshotError(f"snapshot {path} is not a ddptrain snapshot (field {key!r} "
                                f"missing or not {kind.__name__})")
    if not all(isinstance(state["progress"].get(k), int) for k in PROGRESS):
        raise SnapshotError(f"snapshot {path} is not a ddptrain snapshot (progress lacks {PROGRESS})")
    return state


def load_newest(directory: Path, map_location: str | torch.device = "cpu"
                ) -> tuple[Path, dict[str, Any]] | None:
    """The newest snapshot that loads; broken newer ones are skipped with a warning naming them."""
    candidates = list_snapshots(directory)
    skipped: list[SnapshotError] = []
    for path in reversed(candidates):
        try:
            found = path, load_snapshot(path, map_location)
        except SnapshotError as error:
            skipped.append(error)
            continue
        for broken in skipped:
            warnings.warn(f"{broken}; trying the previous snapshot", stacklevel=2)
        return found
    if candidates:
        newest = str(skipped[0]).split(" ", 2)[-1]
        raise SnapshotError(f"no usable snapshot in {directory} ({len(candidates)} found, none readable; the newest: "
                            f"{newest}); start afresh with --resume never or another --run-dir")
    return None


def check_model_matches(current: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]], path: Path) -> None:
    """Name the first mismatch between the model's parameter shapes and a snapshot's."""
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing or unexpected:
        raise SnapshotError(f"snapshot {path} holds another model: missing keys {missing[:3]}, "
                            f"unexpected keys {unexpected[:3]}; use --resume never or another --run-dir")
    for key, shape in current.items():
        if tuple(saved[key]) != tuple(shape):
            raise SnapshotError(f"snapshot {path} holds another model: {key} has shape "
                                f"{tuple(saved[key])}, the model {tuple(shape)}")


def changed_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The fingerprint's keys a resume would change (``check_fingerprint`` refuses it for them)."""
    return [change.split(":", 1)[0] for change in fingerprint_changes(saved, current)]


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Settings that change the math must match, or the resume would not be exact (each setting's
    role says whether it does: settings/roles.py)."""
    changed = fingerprint_changes(saved, current)
    if changed:
        raise SnapshotError(f"snapshot {path} was taken with other settings ({'; '.join(changed)}); "
                            "use the original flags, or --resume never / another --run-dir")
