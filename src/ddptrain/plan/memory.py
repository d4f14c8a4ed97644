"""The most tensor memory a planned rank holds at once, measured while a step runs.

What ``torch.cuda.max_memory_allocated`` reads on a GPU, on any device and through the fake
process group: every tensor storage alive (the parameters, gradients, optimizer state and
buffers held when the step begins, and every storage an op makes while it runs, until freed),
summed at its most. Beside the parts a rank is known to hold, that catches what a step makes
and drops on the way: the optimizer's temporaries (AdamW's foreach step makes two copies of
the moments' size), FSDP's gathered parameters and its buffers, autograd's. FSDP frees and
refills a whole parameter by resizing its storage in place, which is no op a dispatch mode
sees: ``UntypedStorage.resize_`` is followed while the count runs, as torch's own MemTracker
(torch/distributed/_tools/mem_tracker.py) does.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensors(TorchDispatchMode):
    """Bytes of tensor storage alive while active: ``peak``, and ``before_optimizer`` (the peak
    up to the optimizer's step, set by ``optimizer_begins``)."""

    def __init__(self, held: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage (its C++ address while it lives): its bytes
        self.live = self.peak = 0
        self.before_optimizer: int | None = None
        for tensor in held:
            self._track(tensor)

    def __enter__(self) -> LiveTensors:
        self._resize = torch.UntypedStorage.resize_
        live = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = live._resize(storage, size)
            live._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]  # undone on leaving
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out

    def optimizer_begins(self, *_: Any) -> None:
        """(An optimizer's step pre-hook.)"""
        self.before_optimizer = self.peak

    def _track(self, tensor: torch.Tensor) -> None:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: its shard
        try:
            storage = local.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a tensor without one (sparse, a wrapper)
            return
        key = storage._cdata
        if key not in self.sizes:
            self.sizes[key] = 0
            weakref.finalize(storage, self._freed, key)
            self._set(key, storage.nbytes())

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key not in self.sizes:  # made before the count began (held at its size then: 0 when freed)
            self.sizes[key] = 0
            weakref.finalize(storage, self._freed, key)
        self._set(key, storage.nbytes())

    def _set(self, key: int, size: int) -> None:
        self.live += size - self.sizes[key]
        self.sizes[key] = size
        self.peak = max(self.peak, self.live)

    def _freed(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)


def available_memory() -> int | None:
    """This machine's memory available now (MemAvailable), in bytes; None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
