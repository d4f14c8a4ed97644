"""A rank's random states (torch's, CUDA's, Python's and numpy's): captured into its part of each
snapshot (snapshots/rank_parts.py) and restored on resume, so the steps after a resume draw what
they would have drawn (dropout, augmentation, shuffles); and around work that must leave no trace
(parallel/base.leaves_no_trace)."""

from __future__ import annotations

from typing import Any, cast

import torch


def capture_rng() -> dict[str, Any]:
    """This rank's random states, in types ``weights_only`` loading accepts."""
    import random

    import numpy as np

    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = cast(tuple, np.random.get_state(legacy=True))
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
    }


def restore_rng(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32),
                         np_state["pos"], np_state["has_gauss"], np_state["gauss"]))
