"""``ddptrain export``: a run's weights in the formats models ship in.

The weights are the run's ``model.pt`` (the final model), or ``--snapshot N`` (the snapshot
of global step N): a file snapshot's model, or an FSDP run's DCP folder, read whole in this
process (DCP's own loader, no process group). They are written as

- ``safetensors``: one ``.safetensors`` file (tied weights stored once per name, as copies);
- ``hf``: a Hugging Face folder, ``save_pretrained`` of the task's model (the run's task
  factory is called to rebuild it, the weights loaded into it), when it is a transformers model;
- ``torch``: a plain ``state_dict`` file, ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError

FORMATS = ("safetensors", "hf", "torch")


def run_weights(run_dir: Path, snapshot: int | None = None) -> dict[str, torch.Tensor]:
    """The run's final weights, or those of its snapshot at global step ``snapshot``."""
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"{run_dir} holds no ddptrain run (no config.json); give the --run-dir of a run")
    if snapshot is None:
        if not (run_dir / "model.pt").is_file():
            raise ConfigError(f"{run_dir} has no model.pt (the run has not finished); finish it, or export a "
                              f"snapshot with --snapshot N (steps: {', '.join(map(str, _steps(run_dir))) or 'none'})")
        return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)
    from .snapshots import files

    path = files.snapshot_dir(run_dir) / files.snapshot_name(snapshot, folder=False)
    folder = files.snapshot_dir(run_dir) / files.snapshot_name(snapshot, folder=True)
    if folder.is_dir():
        return _dcp_model(folder)
    if path.is_file():
        return files.load_snapshot(path)["model"]
    raise ConfigError(f"{run_dir} has no snapshot of step {snapshot}; its snapshots are of steps: "
                      f"{', '.join(map(str, _steps(run_dir))) or 'none'}")


def _steps(run_dir: Path) -> list[int]:
    from .snapshots import files

    return [files.snapshot_step(p) for p in files.list_snapshots(files.snapshot_dir(run_dir))]


def _dcp_model(folder: Path) -> dict[str, torch.Tensor]:
    """The ``model`` part of a DCP folder, as whole CPU tensors (shapes from its metadata)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    model = {key.removeprefix("model."): torch.empty(tuple(value.size), dtype=value.properties.dtype)
             for key, value in metadata.items()
             if key.startswith("model.") and isinstance(value, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": as meant, one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model}, checkpoint_id=folder, no_dist=True)
    return model


def export(run_dir: Path, fmt: str, out: Path, snapshot: int | None = None) -> str:
    """Write the run's weights as ``fmt`` to ``out``; the line to print."""
    weights = run_weights(run_dir, snapshot)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().clone() for k, v in weights.items()}, str(out),
                  metadata={"ddptrain_run": str(run_dir), "step": str(snapshot or "final")})
    elif fmt == "torch":
        torch.save({k: v.detach().clone() for k, v in weights.items()}, out)
    else:
        _save_pretrained(run_dir, weights, out)
    return f"ddptrain export: {run_dir} ({'step ' + str(snapshot) if snapshot else 'model.pt'}) -> {out} ({fmt})"


def _save_pretrained(run_dir: Path, weights: dict[str, torch.Tensor], out: Path) -> None:
    from . import tasks
    from .settings import from_options

    settings: dict[str, Any] = json.loads((run_dir / "config.json").read_text())
    cfg = from_options({k: v for k, v in settings.items() if v is not None})
    task = tasks.build(cfg)  # the same seed: the same model the run started from
    model = task.model
    if not hasattr(model, "save_pretrained"):
        raise ConfigError(f"the task {cfg.task}'s model is a {type(model).__name__}, not a transformers model; "
                          "--format hf needs one: use --format safetensors or torch")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or [k for k in missing if k not in tied]:
        raise ConfigError(f"the run's weights do not fit the task's model (missing {sorted(missing)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]}); was the task's code changed since the run?")
    model.save_pretrained(out)  # type: ignore[operator]  # a transformers model: checked above


def export_command_hint(run_dir: Path) -> str:
    return f"export: ddptrain export {run_dir} --format safetensors --out {run_dir / 'model.safetensors'}"
