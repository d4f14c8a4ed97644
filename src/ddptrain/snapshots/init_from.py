"""``--init-from PATH``: a fresh run's first weights from elsewhere (weights only: the optimizer,
the schedule and the data start afresh; a resumed run takes its snapshot's weights instead);
with ``--init-optimizer``, a snapshot's optimizer state too (``load_training_state``).

PATH is a state_dict file (``model.pt``, ``.pt``/``.pth``/``.bin``, ``.safetensors``), a
ddptrain snapshot (``step-N.pt``, or a DCP folder ``step-N/``), another run dir (its model.pt),
or a Hugging Face folder (``model.safetensors`` or ``pytorch_model.bin``, sharded ones through
their index; local: nothing is downloaded). Every rank reads it (torch files memory-mapped) and
takes it with torch's ``set_model_state_dict`` (full state dicts: under fsdp each rank keeps
its own shard of each tensor), so every rank starts from the same weights. Strict by default:
a missing or unexpected tensor, or another shape, is one line; ``--init-from-partial`` loads
what matches and names the rest (a tensor of another shape, such as a new head, is left as
built). Tied weights (a language model's head and embedding) count
as present when their twin is.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from ..errors import ConfigError
from . import dcp as snapshot_dcp
from . import files

HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The state_dict at ``path`` (see the module's text), CPU tensors."""
    where = Path(path)
    if not where.exists():
        raise ConfigError(f"--init-from {path}: no such file or folder")
    if where.is_dir():
        return _folder(where, path)
    return _file(where, path)


def _folder(folder: Path, shown: str) -> dict[str, torch.Tensor]:
    if (folder / ".metadata").is_file() and (folder / snapshot_dcp.META).is_file():  # a DCP snapshot
        return snapshot_dcp.whole_model(folder)
    if (folder / "model.pt").is_file():  # a run dir
        return _file(folder / "model.pt", shown)
    for name in HF_WEIGHTS:
        if (folder / name).is_file():
            return _file(folder / name, shown)
        index = folder / f"{name}.index.json"
        if index.is_file():  # sharded: every file the index names
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return {key: value for shard in shards for key, value in _file(folder / shard, shown).items()}
    raise ConfigError(f"--init-from {shown}: this folder holds no weights ddptrain reads (model.pt of a run dir, "
                      f"{' or '.join(HF_WEIGHTS)} of a Hugging Face folder, or a DCP snapshot)")


def _file(file: Path, shown: str) -> dict[str, torch.Tensor]:
    state: Any
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:  # memory-mapped where it can be: torch.save's zip format (a legacy pickle cannot)
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except Exception as error:  # noqa: BLE001 - empty, truncated, another format, a pickle weights_only refuses
        raise ConfigError(f"--init-from {shown}: {file} {_unreadable(file, error)}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict) and "format_version" in state:
        state = state["model"]  # a ddptrain snapshot file
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"--init-from {shown}: {file.name} holds no state_dict (a dict of tensors)")
    return state


def _unreadable(file: Path, error: Exception) -> str:
    """What is wrong with a weights file that did not load, in words (not the loader's advice)."""
    size = file.stat().st_size
    if size == 0:
        return "is empty (0 bytes): it was never written whole; write it again"
    first = str(error).strip().split(". ")[0].splitlines()[0] if str(error).strip() else type(error).__name__
    if file.suffix == ".safetensors":
        return f"is not a readable safetensors file ({size:,} bytes; {first})"
    with open(file, "rb") as handle:
        zip_magic = handle.read(2) == b"PK"  # torch.save's format, cut or changed
    if zip_magic:
        return f"is damaged ({size:,} bytes; {first}): a cut copy? copy it again"
    return (f"is neither a torch.save file nor safetensors ({size:,} bytes; {first}); give a model.pt, "
            ".pt/.bin or .safetensors file")


def load_into(module: torch.nn.Module, weights: dict[str, torch.Tensor], shown: str, partial: bool) -> str:
    """Every rank: ``weights`` into ``module`` (whole or sharded); the line to print."""
    own = module.state_dict()
    tied = _tied_names(module)
    missing = sorted(k for k in own if k not in weights and not (tied.get(k, set()) & weights.keys()))
    unexpected = sorted(k for k in weights if k not in own)
    reshaped = {key: f"{tuple(weights[key].shape)} there, {tuple(own[key].shape)} here"
                for key in sorted(own.keys() & weights.keys()) if tuple(own[key].shape) != tuple(weights[key].shape)}
    if reshaped and not partial:
        key, shapes = next(iter(reshaped.items()))
        raise ConfigError(f"--init-from {shown}: {key} has shape {shapes.replace(' here', ' in the model')}; give "
                          "weights of this model, or add --init-from-partial to leave such tensors as built")
    if (missing or unexpected) and not partial:
        raise ConfigError(f"--init-from {shown}: not this model's weights ({len(missing)} missing, e.g. "
                          f"{missing[:3]}; {len(unexpected)} unexpected, e.g. {unexpected[:3]}); add "
                          "--init-from-partial to load the tensors that match")
    matching: dict[str, Any] = {key: value for key, value in weights.items() if key in own and key not in reshaped}
    line = f"initialised from {shown}: {len(matching)} tensor(s)"  # (torch fills the dict it is given)
    set_model_state_dict(module, matching, options=StateDictOptions(full_state_dict=True, strict=False))
    left = missing + list(reshaped)
    if left or unexpected:
        line += f"; left as built: {left[:5]}{' ...' if len(left) > 5 else ''}; ignored: {unexpected[:5]}"
    if reshaped:
        line += f"; of another shape: {'; '.join(f'{k} {v}' for k, v in list(reshaped.items())[:5])}"
    return line


def _tied_names(module: torch.nn.Module) -> dict[str, set[str]]:
    """Each parameter's other names (tied weights share one tensor)."""
    by_tensor: dict[int, set[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(parameter), set()).add(name)
    return {name: names - {name} for names in by_tensor.values() for name in names}


def snapshot_at(path: str) -> tuple[Path, dict[str, Any]]:
    """--init-optimizer's snapshot, loaded: ``path`` itself (``step-N.pt`` or a DCP folder), or a
    run dir's newest that loads (a broken newer one is skipped with a warning, as a resume does)."""
    where = Path(path)
    if files.SNAPSHOT_NAME.match(where.name) and where.exists():
        return where, files.load_snapshot(where)
    found = files.load_newest(files.snapshot_dir(where)) if files.snapshot_dir(where).is_dir() else None
    if found is None:
        raise ConfigError(f"--init-optimizer: --init-from {path} holds no snapshot, so no optimizer state (a model.pt, "
                          "a .safetensors file or a Hugging Face folder is weights only); give a snapshot "
                          "(RUN_DIR/snapshots/step-N.pt or a DCP folder) or a run dir that has some, or drop "
                          "--init-optimizer")
    return found


def load_training_state(weights: Any, path: str) -> str:
    """Every rank: a snapshot's weights and optimizer state into this run's (``weights``: its
    parallel.base.ModelAndOptimizer), resharded where the layout differs; the optimizer's
    hyper-parameters (rates, weight decay, betas) stay this run's, so its own schedule sets the
    rates from its step 0. The line to print."""
    snapshot, saved = snapshot_at(path)
    optimizer = weights.optimizer
    own = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    current = snapshot_dcp.whole_shapes(cast(dict[str, torch.Tensor], get_model_state_dict(weights.module)))
    if snapshot.is_dir():
        files.check_model_matches(current, snapshot_dcp.saved_shapes(snapshot), snapshot)
        templates = {part: state for part, state in weights.state_dict().items() if part != "ema"}
        state, whole = snapshot_dcp.load_shards(snapshot, templates), False
    else:
        files.check_model_matches(current, snapshot_dcp.whole_shapes(saved["model"]), snapshot)
        state, whole = {"model": saved["model"], "optimizer": saved["optimizer"]}, True
    if len(state["optimizer"].get("param_groups", own)) != len(own):
        raise ConfigError(f"--init-optimizer: {snapshot}'s optimizer has {len(state['optimizer']['param_groups'])} "
                          f"parameter group(s), this run's {len(own)}; give a snapshot of this task's optimizer")
    weights.strategy.load_state(weights.module, optimizer, state, whole)
    for group, hyper in zip(optimizer.param_groups, own):
        group.update(hyper)
    step = saved["progress"]["global_step"]
    return (f"initialised from {snapshot} (step {step}): its weights and its optimizer's state "
            f"({type(optimizer).__name__}'s), under this run's rates and schedule from step 0")
