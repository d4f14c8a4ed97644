"""Sharded snapshots (``--strategy fsdp``): one DCP folder per step, each rank writing its shard.

``dcp.async_save`` copies the shards to CPU memory and returns; the files are written in the
background, on a process group of their own (the training's collectives go on meanwhile).
A snapshot counts only once complete: it is written as ``snapshots/.step-N.partial/``; when
every rank's shard and DCP's metadata are on disk, rank 0 adds ``meta.pt`` (progress,
schedule, RNG states, ...) and renames the folder to ``snapshots/step-N/``. Only then are
older snapshots removed. A ``.partial`` folder (a writer killed mid-way) is never loaded:
it is named in a warning and removed. For a run dir on a store (storage.py), every rank writes
its shards straight there with torch's fsspec writer, and rank 0 commits the folder by
writing ``meta.pt``, then the manifest.
"""

from __future__ import annotations

import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp

from ..storage import RemoteDir
from . import files

META = "meta.pt"


def partial_folder(directory: Path, step: int) -> Path:
    return directory / f".{files.snapshot_name(step, folder=True)}.partial"


def remove_partials(directory: Path) -> None:
    """Rank 0, at start-up: folders a killed writer left behind never count."""
    for partial in sorted(directory.glob(".step-*.partial")) if directory.is_dir() else []:
        warnings.warn(f"snapshot {partial} was never completed (its writer stopped); removing it", stacklevel=2)
        shutil.rmtree(partial, ignore_errors=True)


def commit_remote(future: Future[Any], meta: dict[str, Any], remote: RemoteDir, name: str, keep: int) -> str:
    """Rank 0, for a run dir on a store: DCP's files, then ``meta.pt``, then the manifest."""
    import io

    future.result()
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    remote.fs.pipe_file(remote.path(f"snapshots/{name}/{META}"), buffer.getvalue())
    remote.commit(name)
    remote.rotate(keep)
    return remote.url_of(f"snapshots/{name}")


def commit(future: Future[Any], meta: dict[str, Any], partial: Path, final: Path, keep: int) -> Path:
    """Rank 0: once every rank's shard is written, add the metadata and make it a snapshot."""
    future.result()  # DCP's own metadata is written after every rank's shard
    files.atomic_save(meta, partial / META)
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)  # atomic: the folder appears complete, or not at all
    files.fsync_dir(final.parent)
    files.rotate(final.parent, keep)
    return final


class DCPWriter(files.BackgroundWrite):
    """Every rank: an asynchronous DCP save per snapshot; rank 0 also commits it."""

    def __init__(self, group: Any, is_main: bool, remote: RemoteDir | None = None) -> None:
        self.group, self.is_main, self.remote = group, is_main, remote
        self.last = False
        self.committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddptrain-dcp") if is_main else None

    def submit(self, shards: dict[str, Any], meta: dict[str, Any] | None, directory: Path, step: int,
               keep: int, last: bool = False) -> None:
        """``last``: no step follows before the commit, so the shards are written as they are
        (``dcp.save``), without async_save's copy of them to CPU memory."""
        self.wait()
        self.last = last
        if self.remote is not None:
            self._submit_remote(shards, meta, step, keep)
            return
        partial = partial_folder(directory, step)
        saved = self._save(shards, checkpoint_id=partial, process_group=self.group)
        if self.committer is not None:
            final = directory / files.snapshot_name(step, folder=True)
            self.pending = self.committer.submit(commit, saved, meta or {}, partial, final, keep)
        else:
            self.pending = saved

    def _submit_remote(self, shards: dict[str, Any], meta: dict[str, Any] | None, step: int, keep: int) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # torch 2.4+: not exported

        assert self.remote is not None
        name = files.snapshot_name(step, folder=True)
        writer = FsspecWriter(self.remote.url_of(f"snapshots/{name}"))
        saved = self._save(shards, storage_writer=writer, process_group=self.group)
        if self.committer is not None:
            self.pending = self.committer.submit(commit_remote, saved, meta or {}, self.remote, name, keep)
        else:
            self.pending = saved

    def _save(self, shards: dict[str, Any], **where: Any) -> Future[Any]:
        if not self.last:
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


def saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The model's parameter names and whole shapes in a DCP folder, from its metadata."""
    metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    return {key.removeprefix("model."): tuple(getattr(value, "size", ())) for key, value in metadata.items()
            if key.startswith("model.")}


def whole_shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in state.items()}
