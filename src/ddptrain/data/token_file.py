"""``TokenFile``: a file of token ids larger than memory, as a map-style data set.

The file is nanoGPT's ``.bin`` format: the token ids one after another, each a little-endian
unsigned integer (``uint16`` for vocabularies up to 65,536, else ``uint32``), no header; what
``numpy.memmap`` reads. Sample i is the window ``tokens[i*seq_len : (i+1)*seq_len + 1]`` split
into ``(inputs, targets)``: targets are the inputs shifted by one token.

Nothing is read until a sample is used, and then only its window, with one ``pread``: the
bytes come from the page cache, which is the kernel's, so a rank's memory stays flat however
large the file grows. (Not a kept ``numpy.memmap``: every page a mapping touches counts in
the process's resident memory until it is unmapped, and here a fault maps up to ~600 KB of
a file's page cache at once: 160 random windows of a 100 MB file added 98 MB of RSS through a
memmap, nothing through pread, at 3 us a window. nanoGPT re-creates its memmap every batch
for the same reason.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ConfigError


class TokenFile(Dataset):
    def __init__(self, path: str | os.PathLike[str], seq_len: int, dtype: Any = np.uint16) -> None:
        self.path, self.seq_len, self.dtype = Path(path), seq_len, np.dtype(dtype).newbyteorder("<")
        if seq_len < 1:
            raise ConfigError(f"TokenFile: seq_len must be at least 1, got {seq_len}")
        if not self.path.is_file():
            raise ConfigError(f"TokenFile: {self.path} is not a file; write one with "
                              "examples/write_tokens.py (or nanoGPT's prepare.py)")
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise ConfigError(f"TokenFile: {self.path} holds {size} bytes, not a whole number of "
                              f"{self.dtype.name} tokens; give the dtype it was written with")
        self.tokens_in_file = size // self.dtype.itemsize
        self.windows = (self.tokens_in_file - 1) // seq_len
        if self.windows < 1:
            raise ConfigError(f"TokenFile: {self.path} holds {self.tokens_in_file} tokens, fewer than one "
                              f"window of seq_len {seq_len} + 1")
        self._fd: int | None = None  # opened on first use, in each process that reads

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.windows:
            raise IndexError(f"TokenFile index {index} out of range(0, {self.windows})")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        size = self.dtype.itemsize
        raw = os.pread(self._fd, (self.seq_len + 1) * size, index * self.seq_len * size)
        window = torch.from_numpy(np.frombuffer(raw, dtype=self.dtype).astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        """Pickled into DataLoader workers without the open file (each opens its own)."""
        return {**self.__dict__, "_fd": None}

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)  # type: ignore[arg-type]  # open: checked above
