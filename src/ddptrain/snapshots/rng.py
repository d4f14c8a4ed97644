"""Every rank's random states: captured into each snapshot and restored on resume, so the
steps after a resume draw what they would have drawn (dropout, augmentation, shuffles)."""

from __future__ import annotations

from typing import Any, cast

import torch

RNG_CAPACITY = 1 << 16  # bytes per rank; a CPU rank's pickled RNG states take ~13 KiB


def gather_rng_states(world_size: int, group: Any = None) -> list[dict[str, Any]]:
    """Every rank's RNG states, on every rank: one fixed-size all_gather.

    ``all_gather_object`` needs two collectives and took 3.5-7.5 ms per call on the tutorial
    job (2 CPU ranks), the largest part of an epoch-end snapshot; a fixed-size byte buffer
    needs one. The bytes are pickles from our own ranks, read by our own ranks.
    """
    import pickle

    import torch.distributed as dist

    payload = pickle.dumps(capture_rng())
    if len(payload) + 8 > RNG_CAPACITY:
        raise RuntimeError(f"RNG states take {len(payload)} bytes, more than {RNG_CAPACITY}")
    buffer = torch.zeros(RNG_CAPACITY, dtype=torch.uint8)
    buffer[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    buffer[8:8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [torch.empty_like(buffer) for _ in range(world_size)]
    dist.all_gather(gathered, buffer, group=group)
    states = []
    for tensor in gathered:
        size = int(tensor[:8].view(torch.int64).item())
        states.append(pickle.loads(tensor[8:8 + size].numpy().tobytes()))
    return states


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
