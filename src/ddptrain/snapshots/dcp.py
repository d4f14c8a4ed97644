"""Sharded snapshots (``--strategy fsdp``): one DCP folder per step, each rank writing its shard.

``dcp.async_save`` copies the shards to CPU memory and returns; the files are written in the
background, on a process group of their own (the training's collectives go on meanwhile).
A snapshot counts only once complete: it is written as ``snapshots/.step-N.partial/`` (each
rank's part, rank_parts.py, first, in its ``ranks/``); when every rank's shard and DCP's metadata
are on disk, rank 0 adds ``meta.pt`` (progress, schedule, ...) and renames the folder to
``snapshots/step-N/``. Only then are older snapshots removed. A ``.partial`` folder (a writer
killed mid-way) is never loaded: it is named in a warning and removed. A run dir on a store
(run_dir.py) is written the same way into this machine's mirror, then uploaded behind the
training (uploads.py): rank 0 uploads the folder and commits it there; a rank on another machine
uploads its own shard files and part.
"""

from __future__ import annotations

import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp

from . import files

META = "meta.pt"


def partial_folder(directory: Path, step: int) -> Path:
    return directory / f".{files.snapshot_name(step, folder=True)}.partial"


def remove_partials(directory: Path) -> None:
    """Rank 0, at start-up: folders a killed writer left behind never count."""
    for partial in sorted(directory.glob(".step-*.partial")) if directory.is_dir() else []:
        warnings.warn(f"snapshot {partial} was never completed (its writer stopped); removing it", stacklevel=2)
        shutil.rmtree(partial, ignore_errors=True)


def commit(future: Future[Any], meta: dict[str, Any], partial: Path, final: Path, keep: int,
           uploads: Any = None, spare: frozenset[str] = frozenset()) -> Path:
    """Rank 0: once every rank's shard is written, add the metadata and make it a snapshot
    (``uploads``: a run dir on a store, whose uploader takes it from here)."""
    future.result()  # DCP's own metadata is written after every rank's shard
    files.atomic_save(meta, partial / META)
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)  # atomic: the folder appears complete, or not at all
    files.fsync_dir(final.parent)
    files.rotate(final.parent, keep, spare=spare | set(uploads.pending_snapshots() if uploads is not None else ()))
    if uploads is not None:
        uploads.add_snapshot(final.name)
    return final


class DCPWriter(files.BackgroundWrite):
    """Every rank: an asynchronous DCP save per snapshot; rank 0 also commits it."""

    def __init__(self, group: Any, rank: int, uploads: Any = None, on_main_machine: bool = True) -> None:
        """``uploads``: this rank's uploads.Uploader (a run dir on a store); ``on_main_machine``:
        this rank writes into rank 0's mirror (rank 0 uploads the whole folder)."""
        self.group, self.rank, self.uploads = group, rank, uploads
        self.uploads_part = uploads is not None and not on_main_machine
        self.committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddptrain-dcp") if rank == 0 else None

    def submit(self, shards: dict[str, Any], meta: dict[str, Any] | None, directory: Path, step: int,
               keep: int, last: bool = False) -> None:
        """``last``: no step follows before the commit, so the shards are written as they are
        (``dcp.save``), without async_save's copy of them to CPU memory."""
        self.wait()
        partial = partial_folder(directory, step)
        saved = self._save(shards, last, checkpoint_id=partial, process_group=self.group)
        if self.committer is not None:
            final = directory / files.snapshot_name(step, folder=True)
            self.pending = self.committer.submit(commit, saved, meta or {}, partial, final, keep, self.uploads,
                                                 self.spare)
            return
        if self.uploads_part:
            saved.add_done_callback(lambda done: self._upload_part(done, partial))
        self.pending = saved

    def _upload_part(self, done: Future[Any], partial: Path) -> None:
        """Another machine than rank 0's: this rank's shard files go to the store from here."""
        if done.exception() is None:
            name = partial.name[1:].removesuffix(".partial")
            mine = [*partial.glob(f"__{self.rank}_*.distcp"), *partial.glob(f"ranks/rank-{self.rank:05d}-of-*.pt")]
            self.uploads.add_part(name, [(file, str(file.relative_to(partial))) for file in sorted(mine)])

    @staticmethod
    def _save(shards: dict[str, Any], last: bool, **where: Any) -> Future[Any]:
        if not last:
            # (a Future: async_save returns another type only when asked to, with async_stager)
            return cast(Future, dcp.async_save(shards, **where))
        done: Future[Any] = Future()
        dcp.save(shards, **where)
        done.set_result(None)
        return done

    def close(self, wait: bool = True) -> None:
        if wait:
            self.wait()
        if self.committer is not None:
            self.committer.shutdown(wait=wait, cancel_futures=not wait)


def load_shards(folder: Path, templates: dict[str, Any]) -> dict[str, Any]:
    """Fill ``templates`` (this run's own state dicts, sharded or whole) from a DCP folder;
    DCP reshards when the world size differs."""
    dcp.load(templates, checkpoint_id=folder)
    return templates


def whole_model(folder: Path) -> dict[str, torch.Tensor]:
    """The ``model`` part of a DCP folder, as whole CPU tensors (shapes from its metadata), read
    in this process alone (no process group)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    model = {key.removeprefix("model."): torch.empty(tuple(value.size), dtype=value.properties.dtype)
             for key, value in metadata.items()
             if key.startswith("model.") and isinstance(value, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": as meant, one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model}, checkpoint_id=folder, no_dist=True)
    return model


def saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The model's parameter names and whole shapes in a DCP folder, from its metadata."""
    metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    return {key.removeprefix("model."): tuple(getattr(value, "size", ())) for key, value in metadata.items()
            if key.startswith("model.")}


def holds(folder: Path, part: str) -> bool:
    """Whether a DCP folder holds ``part`` (``ema``: written by a run with --ema)."""
    metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    return any(key.startswith(f"{part}.") for key in metadata)


def whole_shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in state.items()}
