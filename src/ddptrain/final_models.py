"""What a finished run leaves beside its snapshots: ``model.pt`` (the weights, whole, as the
tutorial saved them), the Hugging Face folder when the model describes one, and with --ema
``ema/model.pt`` (the average, whole). Under fsdp every rank helps gather them; rank 0 writes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .parallel.averaging import EMA_DIR, WeightAverage
from .parallel.base import Strategy
from .snapshots.files import HF_MODEL, atomic_save, write_hf_model
from .snapshots.uploads import Uploader


def write_final_models(strategy: Strategy, module: torch.nn.Module, average: WeightAverage | None, run_dir: Path,
                       uploads: Uploader | None) -> None:
    """Every rank calls it; a run dir on a store gets the files uploaded behind them."""
    weights = strategy.full_model_state(module)
    if weights is not None:
        atomic_save(weights, run_dir / "model.pt")
        described = write_hf_model(module, run_dir)  # export --format hf needs no task then
        if uploads is not None:
            uploads.add_file("model.pt")
            if described:
                uploads.add_file(HF_MODEL)
    if average is None:
        return
    with average.swapped_in(lambda: strategy.settle(module)):
        averaged = strategy.full_model_state(module)  # (ddp: the parameters themselves)
        if averaged is not None:
            (run_dir / EMA_DIR).mkdir(exist_ok=True)
            atomic_save(averaged, run_dir / EMA_DIR / "model.pt")
            if uploads is not None:
                uploads.add_file(f"{EMA_DIR}/model.pt")
