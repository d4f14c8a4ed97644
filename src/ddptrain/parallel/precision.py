"""``--precision``: the dtype of bf16 and fp16 (fp32: None, no casting)."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    return DTYPES.get(precision)
