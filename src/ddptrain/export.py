"""``ddptrain export``: a run's weights in the formats models ship in.

The weights are the run's ``model.pt`` (the final model), or ``--snapshot N`` (the snapshot
of global step N): a file snapshot's model, or an FSDP run's DCP folder, read whole in this
process (DCP's own loader, no process group). They are written as

- ``safetensors``: one ``.safetensors`` file (tied weights stored once per name, as copies);
- ``hf``: a Hugging Face folder, ``save_pretrained`` of the run's transformers model (rebuilt
  from hf_model.json, or by the run's task factory for runs from before it, the weights loaded
  into it). A PEFT (LoRA) model writes its adapter, which ``PeftModel.from_pretrained`` loads
  onto the base model; ``--merge`` writes the base model with the adapter merged in instead;
- ``torch``: a plain ``state_dict`` file, ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError
from .settings import BUILT

FORMATS = ("safetensors", "hf", "torch")


# Weights a run keeps beside model.pt: (the flag that keeps them, what they are).
KEPT = {"best": ("--keep-best METRIC (e.g. eval_loss)", "the best evaluation's weights"),
        "ema": ("--ema DECAY (e.g. 0.999)", "the weights' moving average")}


def run_weights(run_dir: Path, snapshot: int | None = None, kept: str | None = None) -> dict[str, torch.Tensor]:
    """The run's final weights, those of its snapshot at global step ``snapshot``, or those it
    kept beside them (``kept``: ``best``, --keep-best's; ``ema``, --ema's average at the end)."""
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"{run_dir} holds no ddptrain run (no config.json); give the --run-dir of a run")
    if kept is not None:
        flag, what = KEPT[kept]
        if not (run_dir / kept / "model.pt").is_file():
            raise ConfigError(f"{run_dir} has no {kept}/model.pt: train with {flag} to keep {what}")
        return torch.load(run_dir / kept / "model.pt", map_location="cpu", weights_only=True)
    if snapshot is None:
        if not (run_dir / "model.pt").is_file():
            raise ConfigError(f"{run_dir} has no model.pt (the run has not finished); finish it, or export a "
                              f"snapshot with --snapshot N (steps: {', '.join(map(str, _steps(run_dir))) or 'none'})")
        return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)
    from .snapshots import files

    path = files.snapshot_dir(run_dir) / files.snapshot_name(snapshot, folder=False)
    folder = files.snapshot_dir(run_dir) / files.snapshot_name(snapshot, folder=True)
    if folder.is_dir():
        from .snapshots.dcp import whole_model  # (torch.distributed.checkpoint: only when needed)

        return whole_model(folder)
    if path.is_file():
        return files.load_snapshot(path)["model"]
    raise ConfigError(f"{run_dir} has no snapshot of step {snapshot}; its snapshots are of steps: "
                      f"{', '.join(map(str, _steps(run_dir))) or 'none'}")


def _steps(run_dir: Path) -> list[int]:
    from .snapshots import files

    return [files.snapshot_step(p) for p in files.list_snapshots(files.snapshot_dir(run_dir))]


def export(run_dir: Path, fmt: str, out: Path, snapshot: int | None = None, force: bool = False,
           shown: str | None = None, kept: str | None = None, merge: bool = False) -> str:
    """Write the run's weights as ``fmt`` to ``out`` (written aside, then moved in: an export cut
    short leaves no part); the line to print. ``shown``: the run dir as the user named it.
    ``merge``: a PEFT model's adapter merged into its base (``hf`` only)."""
    check_out(out, force)
    if merge and fmt != "hf":
        raise ConfigError("--merge merges a LoRA adapter into its base model for --format hf; add --format hf")
    weights = run_weights(run_dir, snapshot, kept)
    model = _pretrained_model(run_dir, weights, merge) if fmt == "hf" else None
    aside = out.with_name(f".{out.name}.{os.getpid()}.export")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().clone() for k, v in weights.items()}, str(aside),
                      metadata={"ddptrain_run": shown or str(run_dir),
                                "step": kept or str(snapshot or "final")})
        elif fmt == "torch":
            torch.save({k: v.detach().clone() for k, v in weights.items()}, aside)
        else:
            model.save_pretrained(aside)  # type: ignore[union-attr]  # a transformers model: _pretrained_model
        _replace(aside, out)
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot write it ({error.strerror or error}); choose a place with room "
                          "you can write to") from None
    finally:
        shutil.rmtree(aside, ignore_errors=True) if aside.is_dir() else aside.unlink(missing_ok=True)
    step = f"{kept}/model.pt" if kept else f"step {snapshot}" if snapshot else "model.pt"
    return f"ddptrain export: {shown or run_dir} ({step}) -> {out} ({fmt})"


def check_out(out: Path, force: bool) -> None:
    """An existing ``--out`` is replaced only with ``--force``; its folder must be writable."""
    if out.exists() and not force:
        raise ConfigError(f"--out {out} exists; pass --force to replace it, or choose another --out")
    exported = any((out / name).is_file() for name in ("config.json", "adapter_config.json"))
    if out.is_dir() and not exported and any(out.iterdir()):
        raise ConfigError(f"--out {out} is a folder that is not an export (no config.json); choose another --out")
    folder = out.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot create {folder} ({error.strerror or error}); choose a place "
                          "you can write to") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {folder} is not writable; choose a place you can write to")


def _replace(aside: Path, out: Path) -> None:
    """``aside`` becomes ``out``: a file in one rename; a folder replaces the old one after it is whole."""
    if out.is_dir():
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        os.replace(out, old)
        os.replace(aside, out)
        shutil.rmtree(old)
    elif out.exists() and aside.is_dir():
        out.unlink()
        os.replace(aside, out)
    else:
        os.replace(aside, out)


def _pretrained_model(run_dir: Path, weights: dict[str, torch.Tensor], merge: bool = False) -> Any:
    """The run's transformers model with ``weights``: from hf_model.json (its class and config,
    written beside model.pt) without the task, else by calling the run's task factory. A PEFT
    model comes back as is (its save_pretrained writes the adapter), or merged (``merge``)."""
    from .snapshots.files import HF_MODEL

    described = run_dir / HF_MODEL
    if described.is_file():
        model = _from_description(json.loads(described.read_text()))
    else:
        model = _from_task(run_dir)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or [k for k in missing if not _tied(k, tied)]:
        raise ConfigError(f"the run's weights do not fit the task's model (missing {sorted(missing)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]}); was the task's code changed since the run?")
    is_peft = hasattr(model, "merge_and_unload")
    if merge and not is_peft:
        raise ConfigError(f"--merge: {run_dir}'s model has no LoRA adapter to merge; drop --merge")
    return model.merge_and_unload() if merge else model


def _tied(key: str, tied: set[str]) -> bool:
    """A weight that is the tie of another (GPT-2's lm_head), also inside a PEFT model's base."""
    return key in tied or key.removeprefix("base_model.model.") in tied


def _from_description(description: dict[str, Any]) -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("--format hf needs transformers; pip install 'ddptrain[hf]'") from None
    cls = getattr(transformers, description["class"], None)
    if cls is None:
        raise ConfigError(f"--format hf: this transformers ({transformers.__version__}) has no "
                          f"{description['class']}; install the version the run trained with")
    model = cls(cls.config_class.from_dict(description["config"]))
    return _with_adapters(model, description["peft"]) if "peft" in description else model


def _with_adapters(model: Any, adapters: dict[str, dict[str, Any]]) -> Any:
    """``model`` wrapped in the run's PEFT adapters (their configs as the run saved them)."""
    try:
        import peft
    except ImportError:
        raise ConfigError("--format hf: the run trained LoRA adapters (PEFT); pip install 'ddptrain[lora]'") from None
    (name, first), *others = adapters.items()
    with warnings.catch_warnings():  # PEFT asks transformers 5 a name it deprecated
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        wrapped = peft.get_peft_model(model, peft.get_peft_config(first), adapter_name=name)
    for other, config in others:
        wrapped.add_adapter(other, peft.get_peft_config(config))
    return wrapped


def _from_task(run_dir: Path) -> Any:
    """A run from before hf_model.json: the task factory rebuilds the model (it may need the data)."""
    from . import tasks
    from .settings.parsing import from_options

    settings: dict[str, Any] = json.loads((run_dir / "config.json").read_text())
    cfg = from_options({k: v for k, v in settings.items() if v is not None and k != BUILT})
    try:
        model = tasks.build(cfg).model  # the same seed: the same model the run started from
    except Exception as error:  # noqa: BLE001 - the user's factory: any failure is named, in one line
        message = " ".join(str(error).split())[:240]
        cause = message if isinstance(error, ConfigError) else f"{type(error).__name__}: {message}"
        raise ConfigError(f"--format hf: {run_dir} has no hf_model.json (trained before ddptrain wrote it), and "
                          f"rebuilding its model from the task {cfg.task} failed ({cause}); make the task's code "
                          "and data reachable again, or use --format safetensors") from None
    if not hasattr(model, "save_pretrained"):
        raise ConfigError(f"the task {cfg.task}'s model is a {type(model).__name__}, not a transformers model; "
                          "--format hf needs one: use --format safetensors or torch")
    return model


def export_command_hint(run_dir: str, kept: str | None = None) -> str:
    """The command that exports the run's model.pt (``kept``: ``best`` or ``ema``, those weights)."""
    out = Path(run_dir).name if "://" in run_dir else str(Path(run_dir) / "model")
    if kept:
        what = "the best" if kept == "best" else "the average"
        return f"export {what}: ddptrain export {run_dir} --{kept} --format safetensors --out {out}-{kept}.safetensors"
    return f"export: ddptrain export {run_dir} --format safetensors --out {out}.safetensors"
