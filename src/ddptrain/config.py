"""The run's configuration: one dataclass, one docstring per field, validated once.

The command line is generated from these fields (cli.py), so a flag, its default and its
help text live in exactly one place. Fields left at ``None`` take the task's default
(see ``Task.defaults``) and then the global one, so ``config.json`` always records the
values that were really used.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """Bad input from the user: reported as one line, exit status 2, nothing started."""


def _opt(help: str, *, choices: tuple[str, ...] | None = None, alias: str | None = None, **kw: Any) -> Any:
    """A config field with the metadata cli.py turns into a flag."""
    return field(metadata={"help": help, "choices": choices, "alias": alias}, **kw)


# Hyper-parameters a task may choose defaults for, and the defaults when it does not.
GLOBAL_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "optimizer": "sgd",
    "momentum": 0.0,
    "weight_decay": 0.0,
}

# Settings that change the math of a run: a snapshot taken under other values cannot be
# resumed as if nothing happened (snapshot.py compares them).
MATH_FIELDS = ("task", "seed", "lr", "optimizer", "momentum", "weight_decay", "lr_schedule",
               "warmup_steps", "max_epochs", "global_batch", "grad_accum", "precision",
               "clip_grad")


@dataclass
class RunConfig:
    # --- what to train ------------------------------------------------------------------
    task: str = _opt("built-in task (regression, digits) or MODULE:FUNC, a factory of your own",
                     default="regression")
    max_epochs: int = _opt("epochs to train (0 evaluates the initial model and stops)",
                           default=5, alias="--max_epochs")
    batch_size: int = _opt("samples per rank per optimizer step (the global batch is this x ranks)",
                           default=32, alias="--batch_size")
    lr: float | None = _opt("learning rate (default: the task's, else 1e-3)", default=None)
    optimizer: str | None = _opt("optimizer (default: the task's, else sgd)",
                                 choices=("sgd", "adamw"), default=None)
    momentum: float | None = _opt("SGD momentum (default: the task's, else 0)", default=None)
    weight_decay: float | None = _opt("weight decay (default: the task's, else 0)", default=None)
    lr_schedule: str = _opt("learning-rate schedule over the optimizer steps",
                            choices=("constant", "cosine", "linear"), default="constant")
    warmup_steps: int = _opt("steps of linear warm-up before the schedule", default=0)
    seed: int = _opt("seed for data, initial weights and shuffling (same on every rank)", default=0)
    run_dir: str | None = _opt("where config, metrics, snapshots and model.pt go "
                               "(default: a new folder under runs/)", default=None)

    # --- where and how to run -----------------------------------------------------------
    nproc: str = _opt("local ranks when not under a launcher: a number, or auto "
                      "(one per GPU; 2 CPU ranks without GPUs)", default="auto")
    device: str = _opt("compute device", choices=("auto", "cpu", "cuda"), default="auto")
    backend: str = _opt("process-group backend (auto: nccl on CUDA, else gloo)",
                        choices=("auto", "gloo", "nccl"), default="auto")
    timeout: float = _opt("seconds a collective may wait for the other ranks before the job fails",
                          default=300.0)
    max_restarts: int = _opt("restarts of all local ranks after a failure (local launch; under "
                             "torchrun use its own --max-restarts)", default=0)
    workers: int = _opt("DataLoader worker processes per rank (data sets that are not "
                        "in-memory tensors)", default=0)

    # --- snapshots ----------------------------------------------------------------------
    save_every: int = _opt("write a snapshot every N optimizer steps (0: only at epoch ends "
                           "and at the end)", default=0)
    keep: int = _opt("snapshots kept in RUN_DIR/snapshots", default=2)
    resume: str = _opt("auto (newest complete snapshot in the run dir), never, or a snapshot path",
                       default="auto")

    # --- speed and precision ------------------------------------------------------------
    precision: str = _opt("autocast precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    grad_accum: int = _opt("micro-batches accumulated per optimizer step (no_sync on all but "
                           "the last)", default=1)
    clip_grad: float | None = _opt("clip the global gradient norm to this value", default=None)
    comm_hook: str = _opt("DDP communication hook",
                          choices=("none", "fp16", "bf16", "powersgd"), default="none")
    compile: bool = _opt("torch.compile the model before wrapping it in DDP", default=False)
    static_graph: bool = _opt("tell DDP the graph is the same every step", default=False)
    bucket_cap_mb: float | None = _opt("DDP gradient bucket size in MiB (default: DDP's 25)",
                                       default=None)
    find_unused_parameters: bool = _opt("let DDP handle parameters that get no gradient "
                                        "(slower; only for models that need it)", default=False)

    # --- evaluation and reporting -------------------------------------------------------
    eval_every: int = _opt("evaluate every N epochs (and at the end) when the task has an "
                           "evaluation set; 0: only at the end", default=1)
    log_ranks: bool = _opt("every rank prints the tutorial's per-epoch line", default=False)
    progress: bool | None = _opt("progress bar on rank 0 (default: when stderr is a terminal)",
                                 default=None)
    tensorboard: bool = _opt("write TensorBoard event files into the run dir", default=False)

    # ---------------------------------------------------------------------------------------
    def hparam(self, name: str) -> Any:
        """A hyper-parameter as resolved: the flag, else GLOBAL_DEFAULTS."""
        value = getattr(self, name)
        return GLOBAL_DEFAULTS[name] if value is None else value

    def with_task_defaults(self, defaults: dict[str, Any]) -> RunConfig:
        """Fill fields the user left unset with the task's choices, then the global ones."""
        unknown = set(defaults) - set(GLOBAL_DEFAULTS)
        if unknown:
            raise ConfigError(f"task defaults name unknown settings {sorted(unknown)}; "
                              f"allowed: {sorted(GLOBAL_DEFAULTS)}")
        filled = {k: (defaults.get(k, GLOBAL_DEFAULTS[k]) if getattr(self, k) is None
                      else getattr(self, k)) for k in GLOBAL_DEFAULTS}
        return dataclasses.replace(self, **filled)

    def math_fingerprint(self, world_size: int) -> dict[str, Any]:
        """The settings a snapshot must share with the run that resumes it."""
        values = {k: getattr(self, k) for k in MATH_FIELDS if k != "global_batch"}
        values["global_batch"] = self.batch_size * world_size * self.grad_accum
        if self.lr_schedule == "constant":  # more epochs only extend a constant schedule
            del values["max_epochs"]
        return values

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def default_run_dir() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")


def parse_nproc(value: str) -> int | None:
    """``auto`` -> None; a positive count -> int; anything else -> ConfigError."""
    if value == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        raise ConfigError(f"--nproc must be a number or 'auto', got {value!r}") from None
    if count < 1:
        raise ConfigError(f"--nproc must be at least 1, got {count}")
    return count


def validate(cfg: RunConfig) -> None:
    """Checks that need nothing but the config. Raises ConfigError with a one-line fix."""
    checks = [
        (cfg.batch_size >= 1, f"--batch-size must be at least 1, got {cfg.batch_size}"),
        (cfg.max_epochs >= 0, f"--max-epochs must be 0 or more, got {cfg.max_epochs}"),
        (cfg.lr is None or (math.isfinite(cfg.lr) and cfg.lr >= 0),
         f"--lr must be a finite number >= 0, got {cfg.lr}"),
        (math.isfinite(cfg.timeout) and cfg.timeout > 0,
         f"--timeout must be a positive number of seconds, got {cfg.timeout}"),
        (cfg.momentum is None or 0 <= cfg.momentum < 1, f"--momentum must be in [0, 1), got {cfg.momentum}"),
        (cfg.weight_decay is None or cfg.weight_decay >= 0,
         f"--weight-decay must be >= 0, got {cfg.weight_decay}"),
        (cfg.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {cfg.warmup_steps}"),
        (cfg.workers >= 0, f"--workers must be >= 0, got {cfg.workers}"),
        (cfg.save_every >= 0, f"--save-every must be >= 0 (0: epoch ends only), got {cfg.save_every}"),
        (cfg.keep >= 1, f"--keep must be at least 1, got {cfg.keep}"),
        (cfg.max_restarts >= 0, f"--max-restarts must be >= 0, got {cfg.max_restarts}"),
        (cfg.eval_every >= 0, f"--eval-every must be >= 0, got {cfg.eval_every}"),
        (cfg.grad_accum >= 1, f"--grad-accum must be at least 1, got {cfg.grad_accum}"),
        (cfg.clip_grad is None or cfg.clip_grad > 0, f"--clip-grad must be > 0, got {cfg.clip_grad}"),
        (cfg.bucket_cap_mb is None or cfg.bucket_cap_mb > 0,
         f"--bucket-cap-mb must be > 0, got {cfg.bucket_cap_mb}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    parse_nproc(cfg.nproc)
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).is_file():
        raise ConfigError(f"--resume {cfg.resume}: no such snapshot file; "
                          "use auto, never, or the path of a snapshot")
    _check_run_dir_writable(cfg.run_dir)


def _check_run_dir_writable(run_dir: str | None) -> None:
    if run_dir is None:
        return
    path = Path(run_dir)
    existing = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    if not existing.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: {existing} is a file, not a folder; "
                          "choose another --run-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--run-dir {run_dir}: {existing} is not writable; "
                          "choose a folder you can write to")
