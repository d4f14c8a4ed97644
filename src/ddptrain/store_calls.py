"""Calls on an object store that end: a store that refuses fails a call at once, and one that
accepts connections and never answers (a partition that drops packets) fails it in bounded time
too, so its caller (snapshots/uploads.py, a run's start) retries or says so instead of waiting.

run_dir.py's ``StoreRunDir`` is the one user; no other module knows fsspec.
"""

from __future__ import annotations

import os
from typing import Any

STORE_READ_TIMEOUT_S = 7  # seconds an S3 request may wait for the store's answer
STORE_TRIES = 2  # s3fs's attempts of a request
STORE_CALL_S = 10.0  # the most a call on the store may take (a transfer: more, by its size)
STORE_SLOWEST_MB_S = 1.0  # the slowest transfer rate a call is given time for
STORE_MOVE_S = 300.0  # moving an earlier run's files aside (copies on the store's side)


def store_filesystem(scheme: str) -> BoundedStore:
    """fsspec's filesystem for ``scheme`` (listings never cached: other machines write too), its
    calls bounded. S3's client gives up on a silent request after STORE_READ_TIMEOUT_S, tried
    STORE_TRIES times, not botocore's 60 s read timeout times its and s3fs's retries (over 6
    minutes, measured)."""
    import fsspec

    options = {"config_kwargs": {"connect_timeout": 5, "read_timeout": STORE_READ_TIMEOUT_S,
                                 "retries": {"total_max_attempts": 1}}} if scheme == "s3" else {}
    fs = fsspec.filesystem(scheme, use_listings_cache=False, skip_instance_cache=True, **options)
    if scheme == "s3":
        fs.retries = STORE_TRIES  # s3fs's own retries of a timed-out request (5 by default)
    _quiet_dropped_connections()
    return BoundedStore(fs)


class BoundedStore:
    """An fsspec filesystem whose calls are bounded in time with fsspec's own ``timeout`` (the
    call's coroutine is cancelled, its connection closed). A store that accepts and never answers
    (a partition that drops packets) then fails a call like a store that refuses, and the caller
    retries (snapshots/uploads.py): s3fs's uploads waited on such a store for minutes, past any
    read timeout (measured: a 1 KB put through a silent proxy had not returned after 200 s)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.fs, name)
        if not callable(call) or not hasattr(self.fs, f"_{name}"):  # only async methods' mirrors take a timeout
            return call

        def bounded(*args: Any, **kwargs: Any) -> Any:
            return call(*args, timeout=self.seconds(name, args), **kwargs)
        return bounded

    def seconds(self, name: str, args: tuple[Any, ...]) -> float:
        if name == "put_file":
            return STORE_CALL_S + os.path.getsize(args[0]) / (STORE_SLOWEST_MB_S * 1e6)
        if name == "get_file":
            return STORE_CALL_S + self.size(args[0]) / (STORE_SLOWEST_MB_S * 1e6)
        return STORE_MOVE_S if name == "mv" else STORE_CALL_S


def _quiet_dropped_connections() -> None:
    """A store that drops its connections leaves aiohttp's write tasks failed and never awaited
    (the request itself failed, and is retried): asyncio would print each as "Task exception was
    never retrieved" with a traceback. fsspec's event loop (its own thread) drops those; any
    other problem there is reported as asyncio would."""
    import fsspec.asyn

    loop = fsspec.asyn.get_loop()

    def handler(loop: Any, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), ConnectionError) and "never retrieved" in context.get("message", ""):
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
