"""A nanoGPT config file (``config/*.py``) as settings: ``--config config/train_shakespeare_char.py``.

The file is read, never run: each ``NAME = VALUE`` whose value is a literal (or arithmetic of
literals: ``5 * 8``) is taken; any other statement is skipped and named. Training keys become
their flags (``max_iters`` N is ``--max-steps N + 1``: nanoGPT steps at iterations 0 to N), the
model's and data's keys become task options (``--task-opt n_layer=6``), and a key with no
counterpart is named in one line each, with what to do instead.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# nanoGPT's model and data keys: a task's own settings (--task-opt), not ddptrain's
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "dropout", "bias", "block_size", "vocab_size", "dataset")
# nanoGPT's key -> ddptrain's setting, where the value carries over as it is
SAME_VALUE = {"out_dir": "run_dir", "eval_interval": "eval_every_steps", "eval_iters": "eval_batches",
              "log_interval": "log_every", "batch_size": "batch_size", "learning_rate": "lr",
              "weight_decay": "weight_decay", "warmup_iters": "warmup_steps", "min_lr": "min_lr",
              "gradient_accumulation_steps": "grad_accum", "compile": "compile", "backend": "backend"}
PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
BETAS = (0.9, 0.95)  # nanoGPT train.py's beta1, beta2
# nanoGPT train.py's defaults where ddptrain's differ: a file that leaves them out gets ddptrain's (said)
TRAIN_PY_DEFAULTS = {"learning_rate": 6e-4, "weight_decay": 0.1, "beta2": 0.95, "grad_clip": 1.0, "decay_lr": True,
                     "warmup_iters": 2000, "max_iters": 600000, "log_interval": 1, "eval_interval": 2000}
NO_COUNTERPART = {
    "always_save_checkpoint": "snapshots are always written (--save-seconds, --save-every); --keep-best eval_loss "
                              "keeps the best evaluation's weights apart",
    "wandb_project": "give it to wandb as WANDB_PROJECT (with --tracker wandb)",
    "wandb_run_name": "give it to wandb as WANDB_NAME (with --tracker wandb)",
}
_ARITHMETIC: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def read(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The file's settings (ddptrain's names) and the lines that say what was left out and why."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as error:
        raise ConfigError(f"--config {path}: not valid Python (line {error.lineno}: {error.msg})") from None
    values: dict[str, Any] = {}
    notes: list[str] = []
    for statement in tree.body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # a docstring
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1 and
                isinstance(target := statement.targets[0], ast.Name)):
            notes.append(f"line {statement.lineno}: skipped ({ast.unparse(statement)[:60]}): the file is read, "
                         "never run; only NAME = VALUE is taken")
            continue
        try:
            values[target.id] = _literal(statement.value)
        except ValueError:
            notes.append(f"line {statement.lineno}: {target.id} skipped: {ast.unparse(statement.value)[:60]} is not "
                         "a literal (the file is read, never run); give its value as a flag")
    settings, said = settings_of(values)
    return settings, notes + said


def _literal(node: ast.expr) -> Any:
    """A constant, or arithmetic of constants (``5 * 8``); ValueError for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool)):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](_literal(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _literal(node.left), _literal(node.right)
        if isinstance(left, (int, float)) and isinstance(right, (int, float)):
            return _ARITHMETIC[type(node.op)](left, right)
    raise ValueError(ast.dump(node))


def settings_of(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """nanoGPT's keys as ddptrain's settings, and a line for each key that has no counterpart."""
    settings: dict[str, Any] = {name: config[key] for key, name in SAME_VALUE.items() if key in config}
    notes: list[str] = []
    options = {key: value for key, value in config.items() if key in MODEL_KEYS}
    if options:
        settings["task_opt"] = options
    if "max_iters" in config:
        settings["max_steps"] = config["max_iters"] + 1
    if "beta1" in config or "beta2" in config:
        settings["betas"] = f"{config.get('beta1', BETAS[0])},{config.get('beta2', BETAS[1])}"
    if config.get("grad_clip", 0.0):
        settings["clip_grad"] = config["grad_clip"]
    decays = config.get("decay_lr", any(key in config for key in ("warmup_iters", "lr_decay_iters", "min_lr")))
    settings["lr_schedule"] = "cosine" if decays else "constant"
    if decays and config.get("lr_decay_iters", config.get("max_iters")) != config.get("max_iters"):
        notes.append(f"lr_decay_iters {config['lr_decay_iters']}: the cosine here decays over --max-steps; "
                     "nanoGPT's own schedule is Task.make_scheduler = nanogpt_schedule(...) (docs/from-nanogpt.md)")
    if "eval_interval" in config:  # nanoGPT evaluates at iteration 0, then every eval_interval, never by epochs
        settings.update(eval_at_start=True, eval_every=0)
    if config.get("eval_only"):
        settings["max_epochs"] = 0
    if config.get("wandb_log"):
        settings["tracker"] = "wandb"
    if "dtype" in config:
        settings["precision"] = PRECISION.get(config["dtype"], config["dtype"])
    if str(config.get("device", "")).startswith("cpu"):
        settings["device"] = "cpu"
    if config.get("gradient_accumulation_steps", 1) > 1:
        notes.append(f"gradient_accumulation_steps {config['gradient_accumulation_steps']}: nanoGPT divides it by "
                     "the number of ranks, --grad-accum is per rank: on N ranks give it / N for nanoGPT's batch")
    if config.get("init_from", "scratch") != "scratch":
        notes.append(f"init_from {config['init_from']!r}: the same command resumes its run; --init-from FOLDER "
                     "starts from a local Hugging Face folder's weights")
    absent = [f"{key} {value!r}" for key, value in TRAIN_PY_DEFAULTS.items() if key not in config]
    if absent:
        notes.append(f"keys this file leaves out take ddptrain's defaults, not nanoGPT train.py's ({', '.join(absent)} "
                     "there); give them as flags (docs/flags.md) where they matter")
    taken = {*SAME_VALUE, *MODEL_KEYS, "max_iters", "beta1", "beta2", "grad_clip", "decay_lr", "lr_decay_iters",
             "eval_only", "wandb_log", "dtype", "device", "init_from", "warmup_iters", "min_lr"}
    for key in config:
        if key not in taken:
            notes.append(f"{key}: {NO_COUNTERPART.get(key, 'no ddptrain setting; left out')}")
    return settings, notes
