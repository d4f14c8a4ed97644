"""The run's configuration: one frozen dataclass, one help text per field, validated once (config_checks.py).

The command line (cli.py), settings files (``--config FILE.toml`` or a run's own
``config.json``) and ``ddptrain.fit(**options)`` all become a ``RunConfig`` through
``settings.from_options``, so a setting's name, type, default and help live in exactly one place.
A ``RunConfig`` never changes once made: later stages derive new ones with
``dataclasses.replace`` (the task's defaults, a resumed run's batch size), and
``config.json`` records the values really used.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError  # also ddptrain.config.ConfigError
from .run_dir import default_name


def _opt(help: str, *, choices: tuple[str, ...] | None = None, alias: str | None = None, many: bool = False,
         **kw: Any) -> Any:
    """A config field with the metadata cli.py turns into a flag. ``many``: a comma-separated
    list (a list in a settings file or a keyword argument)."""
    return field(metadata={"help": help, "choices": choices, "alias": alias, "many": many}, **kw)


BUILT = "built"  # config.json's key for what the run built (the optimizer, the schedule): not a setting
DEFAULT_EPOCHS = 5  # when neither --max-epochs nor --max-steps is given
SYNC_EVERY, OUTER_LR, OUTER_MOMENTUM = 50, 0.7, 0.9  # --sync local-sgd|diloco (DiLoCo's paper: 500, 0.7, 0.9)
TRACKERS = ("csv", "tensorboard", "mlflow", "wandb")  # observe/trackers.py
ADAM_BETAS, ADAM_EPS = "0.9,0.999", 1e-8  # torch's AdamW defaults
LOG_EVERY, LOG_TIMES = 10, 4  # --log-every's default: every 10 steps, or 4 times in a shorter run

# Hyper-parameters a task may choose defaults for, and the defaults when it does not.
GLOBAL_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "optimizer": "sgd",
    "momentum": 0.0,
    "weight_decay": 0.0,
}

# Settings that change the math of a run: a snapshot taken under other values cannot be
# resumed as if nothing happened (snapshots/restore.py compares them).
MATH_FIELDS = ("task", "seed", "lr", "optimizer", "momentum", "weight_decay", "lr_schedule",
               "warmup_steps", "max_epochs", "max_steps", "global_batch", "grad_accum", "precision",
               "clip_grad", "sync_batchnorm", "min_lr", "betas", "eps")

# Settings in the math that fingerprints hold only where they differ from these values (their
# defaults): a snapshot written before they existed, or with them left alone, matches.
MATH_OMITTED_AT = {"min_lr": 0.0, "betas": ADAM_BETAS, "eps": ADAM_EPS}

# Settings a resume keeps too, though snapshots written before them do not hold them, so those
# are not asked about them: the average (--ema) and the figure best/ is judged by (--keep-best),
# which leave the math of the weights alone (not held before 0.5); --replicas under --sync, which
# is in the math but was not held until 2026-12-05.
KEPT_ON_RESUME = ("ema", "ema_every", "keep_best", "replicas")

# Settings that do not define *which* run this is: changing them keeps the default run dir,
# so the same command (or the same command with more epochs) finds its run again.
NOT_IDENTITY = ("run_dir", "resume", "max_epochs", "max_steps", "progress", "tensorboard", "tracker", "plot",
                "log_ranks", "timeout", "max_restarts", "keep", "save_every", "save_seconds", "mttf_hours",
                "eval_every", "eval_every_steps", "workers", "peak_tflops", "profile", "lean_cpu_memory", "keep_best",
                "early_stop", "early_stop_delta", "ema", "ema_every", "lighthouse", "log_every", "eval_batches",
                "final_eval")


@dataclass(frozen=True)
class RunConfig:
    # --- what to train ------------------------------------------------------------------
    task: str = _opt("built-in task (regression, digits) or MODULE:FUNC, a factory of your own",
                     default="regression")
    max_epochs: int | None = _opt(f"epochs to train (default {DEFAULT_EPOCHS}; no limit with --max-steps); 0 "
                                  "evaluates the initial model and stops", default=None, alias="--max_epochs")
    max_steps: int | None = _opt("optimizer steps to train, across epoch boundaries; with --max-epochs too, "
                                 "the first limit reached ends the run", default=None)
    batch_size: int = _opt("samples per rank per micro-batch; the global batch is this x ranks "
                           "x --grad-accum", default=32, alias="--batch_size")
    lr: float | None = _opt("learning rate (default: the task's, else 1e-3)", default=None)
    optimizer: str | None = _opt("optimizer (default: the task's, else sgd)",
                                 choices=("sgd", "adamw"), default=None)
    momentum: float | None = _opt("SGD momentum (default: the task's, else 0)", default=None)
    weight_decay: float | None = _opt("weight decay (default: the task's, else 0)", default=None)
    lr_schedule: str = _opt("learning-rate schedule over the optimizer steps",
                            choices=("constant", "cosine", "linear"), default="constant")
    warmup_steps: int = _opt("steps of linear warm-up before the schedule", default=0)
    min_lr: float = _opt("the rate cosine and linear decay end at (nanoGPT's min_lr)", default=0.0)
    betas: str = _opt("adamw: its two decay rates, B1,B2 (nanoGPT uses 0.9,0.95 or 0.9,0.99)",
                      default=ADAM_BETAS)
    eps: float = _opt("adamw: the term added to its denominator", default=ADAM_EPS)
    seed: int = _opt("seed for data, initial weights and shuffling (same on every rank)", default=0)
    run_dir: str | None = _opt("where config, metrics, snapshots and model.pt go (default: "
                               "runs/TASK-HASH, named after the task and the settings, so the "
                               "same command finds its run again)", default=None)

    # --- where and how to run -----------------------------------------------------------
    nproc: str = _opt("local ranks when not under a launcher: a number, or auto "
                      "(one per GPU; 2 CPU ranks without GPUs)", default="auto")
    device: str = _opt("compute device", choices=("auto", "cpu", "cuda"), default="auto")
    backend: str = _opt("process-group backend (auto: nccl on CUDA, else gloo)",
                        choices=("auto", "gloo", "nccl"), default="auto")
    timeout: float = _opt("seconds every rank may take to reach a collective (start-up, a step, "
                          "an evaluation) before the job stops and names the rank that did not "
                          "arrive", default=300.0)
    max_restarts: int = _opt("restarts of all local ranks after a failure (local launch; under "
                             "torchrun use its own --max-restarts)", default=0)
    workers: int = _opt("DataLoader worker processes per rank, for training and evaluation "
                        "(data sets that are not in-memory tensors)", default=0)
    strategy: str = _opt("ddp replicates the model on every rank; fsdp shards parameters, "
                         "gradients and optimizer state (FSDP2); hsdp shards inside each of --replicas "
                         "groups and replicates across them (FSDP2 on a 2-D mesh)",
                         choices=("ddp", "fsdp", "hsdp"), default="ddp")
    replicas: int | None = _opt("hsdp, --sync local-sgd|diloco: the number of replica groups (the ranks split "
                                "into that many groups of consecutive ranks; under hsdp each holds the whole "
                                "model sharded over its ranks); default: one per node", default=None)
    sync: str = _opt("how the replica groups keep one model: every-step (the gradients meet every step); "
                     "local-sgd (each group trains alone, DDP inside it, and every --sync-every steps the groups "
                     "average their weights); diloco (every --sync-every steps an outer Nesterov SGD step moves "
                     "the last synced weights by the groups' mean change; docs/slow-links.md)",
                     choices=("every-step", "local-sgd", "diloco"), default="every-step")
    sync_every: int | None = _opt(f"local-sgd, diloco: optimizer steps between syncs (default {SYNC_EVERY})",
                                  default=None)
    outer_lr: float | None = _opt(f"diloco: the outer SGD's learning rate (default {OUTER_LR})", default=None)
    outer_momentum: float | None = _opt(f"diloco: the outer SGD's Nesterov momentum (default {OUTER_MOMENTUM}; 0: "
                                        "plain SGD)", default=None)
    fault_tolerance: str = _opt("torchft: this job is one replica group of --replica-groups; the groups average "
                                "their gradients every step through torchft, and when one fails the others train "
                                "on while it restarts and heals from a live peer (pip install 'ddptrain[ft]'; "
                                "docs/fault-tolerance.md)", choices=("none", "torchft"), default="none")
    replica_group: int = _opt("--fault-tolerance torchft: this job's replica group, 0 to --replica-groups - 1",
                              default=0)
    replica_groups: int = _opt("--fault-tolerance torchft: how many replica groups train the run (each a job "
                               "of its own, with the same settings)", default=1)
    lighthouse: str = _opt("--fault-tolerance torchft: the torchft lighthouse every group reaches, "
                           "http://HOST:PORT (default: TORCHFT_LIGHTHOUSE; `ddptrain lighthouse` starts one)",
                           default="")
    reshard_after_forward: bool = _opt("fsdp: free gathered parameters after the forward pass "
                                       "(less memory, one more all-gather in backward)", default=True)
    activation_checkpointing: bool = _opt("recompute each block's activations in backward "
                                          "instead of keeping them (less memory, more compute)",
                                          default=False)

    # --- snapshots ----------------------------------------------------------------------
    save_every: int = _opt("also write a snapshot every N optimizer steps (0: off)", default=0)
    save_seconds: float = _opt("write a snapshot when this many seconds of training passed since "
                               "the last one (stretched so snapshots cost at most 2%% of training "
                               "time; 0: off); snapshots are also written at the end and on a "
                               "stop signal", default=60.0)
    mttf_hours: float = _opt("the job's mean time between failures, in hours: snapshots by time then "
                             "come every sqrt(2 x a snapshot's blocking time x MTTF) s, the interval "
                             "that loses least to snapshots and redone steps (Young's rule), in place "
                             "of --save-seconds, which times the first (0: off)", default=0.0)
    keep: int = _opt("snapshots kept in RUN_DIR/snapshots", default=2)
    resume: str = _opt("auto (newest complete snapshot in the run dir), never (a fresh start; an "
                       "earlier run's files there are moved aside; the job's own restarts resume its "
                       "snapshots), or a snapshot path", default="auto")

    # --- speed, precision and numerics -------------------------------------------------
    precision: str = _opt("autocast precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    grad_accum: int = _opt("micro-batches accumulated per optimizer step (gradients are "
                           "synchronised on the last one only)", default=1)
    clip_grad: float | None = _opt("clip the global gradient norm to this value", default=None)
    skip_nonfinite: int = _opt("skip optimizer steps whose loss or gradient is not finite, on every "
                               "rank together, and stop after this many (0: stop at the first)",
                               default=0)
    comm_hook: str = _opt("ddp: gradient communication hook",
                          choices=("none", "fp16", "bf16", "powersgd"), default="none")
    compile: bool = _opt("torch.compile the model before wrapping it", default=False)
    lean_cpu_memory: bool = _opt("CPU ranks under glibc's allocator (fit(), or DDPTRAIN_ALLOCATOR=system): give "
                                 "every freed buffer over 1 MiB back to the OS at once (glibc's mmap threshold); "
                                 "under fsdp the peak resident memory then falls to about 0.6x, at about half the "
                                 "speed (README: FSDP); no effect under mimalloc (ddptrain train's CPU default) "
                                 "or on GPUs", default=False)
    static_graph: bool = _opt("ddp: tell DDP the graph is the same every step", default=False)
    bucket_cap_mb: float | None = _opt("ddp: gradient bucket size in MiB (default: DDP's own, 25)",
                                       default=None)
    find_unused_parameters: bool = _opt("ddp: handle parameters that get no gradient "
                                        "(slower; only for models that need it)", default=False)
    sync_batchnorm: bool = _opt("BatchNorm layers normalise with the whole global batch's statistics "
                                "(torch's SyncBatchNorm, GPUs only); plain BatchNorm normalises each "
                                "rank's batch", default=False)

    # --- evaluation and reporting -------------------------------------------------------
    eval_every: int = _opt("evaluate every N epochs (and at the end) when the task has an "
                           "evaluation set; 0: only at the end", default=1)
    eval_every_steps: int = _opt("also evaluate every N optimizer steps (0: off)", default=0)
    eval_batches: int = _opt("evaluate on N batches of --batch-size, the same samples at every evaluation (a "
                             "subset drawn once from --seed, so figures compare across the run and across world "
                             "sizes; nanoGPT's eval_iters); 0: the whole evaluation set", default=0)
    final_eval: str = _opt("the run's last evaluation: full (the whole evaluation set, whatever --eval-batches "
                           "says) or same (--eval-batches' subset, like the others)",
                           choices=("full", "same"), default="full")
    init_from: str = _opt("a fresh run's first weights: a model.pt or .safetensors file, a snapshot, another run "
                          "dir, or a Hugging Face folder (weights only; a resumed run ignores it)", default="")
    init_from_partial: bool = _opt("--init-from loads the tensors that match this model and names the rest "
                                   "(default: any difference is an error)", default=False)
    keep_best: str = _opt("keep RUN_DIR/best/model.pt, the weights of the best evaluation by METRIC[:min|max] "
                          "(an eval_* figure, e.g. eval_loss; min for names ending in loss, else max)", default="")
    early_stop: int = _opt("end the run after N evaluations in a row without an improvement of the --keep-best "
                           "metric (0: off)", default=0)
    early_stop_delta: float = _opt("the least change of the --keep-best metric that counts as an improvement "
                                   "for --early-stop", default=0.0)
    ema: float = _opt("keep an exponential moving average of the weights with this decay (0: off; e.g. 0.999): "
                      "evaluated beside the weights (ema_eval_*), in every snapshot, written to RUN_DIR/ema/model.pt",
                      default=0.0)
    ema_every: int = _opt("update the --ema average every N optimizer steps", default=1)
    log_every: int | None = _opt(f"a step record every N optimizer steps: the mean training loss over them (every "
                                 f"rank's, as the optimizer saw it), the rate, the gradient norm and training-only "
                                 f"throughput, in metrics.jsonl, the trackers and, without a progress bar, the "
                                 f"console (default: {LOG_EVERY}, or {LOG_TIMES} times in a shorter run; 0: off)",
                                 default=None)
    log_ranks: bool = _opt("every rank prints the tutorial's per-epoch line", default=False)
    progress: bool | None = _opt("progress bar on rank 0 (default: when stderr is a terminal)",
                                 default=None)
    tensorboard: bool = _opt("write TensorBoard event files into the run dir (--tracker tensorboard)", default=False)
    tracker: str = _opt(f"send metrics, settings and files to experiment trackers, comma-separated: "
                        f"{', '.join(TRACKERS)} (MLflow reads MLFLOW_TRACKING_URI, W&B its WANDB_* variables)",
                        default="", many=True)
    peak_tflops: float | None = _opt("one device's peak TFLOP/s, for MFU (default: a table of GPUs' dense "
                                     "bf16 peaks; none on CPU)", default=None)
    profile: int = _opt("record steps 2..N+1 with torch.profiler: RUN_DIR/profile/rank-R.json (Chrome / "
                        "Perfetto traces); 0: off", default=0)
    plot: bool = _opt("draw RUN_DIR/curves.png at the end (matplotlib; 0.5-1 s, so off by default: "
                      "`ddptrain report RUN_DIR` draws it any time)", default=False)

    # ---------------------------------------------------------------------------------------
    def hparam(self, name: str) -> Any:
        """A hyper-parameter as resolved: the setting, else GLOBAL_DEFAULTS."""
        value = getattr(self, name)
        return GLOBAL_DEFAULTS[name] if value is None else value

    def with_task_defaults(self, defaults: Mapping[str, Any]) -> RunConfig:
        """Fill settings the user left unset with the task's choices, then the global ones."""
        unknown = set(defaults) - set(GLOBAL_DEFAULTS)
        if unknown:
            raise ConfigError(f"Task.defaults names unknown settings {sorted(unknown)}; "
                              f"allowed: {sorted(GLOBAL_DEFAULTS)}")
        filled = {k: (defaults.get(k, GLOBAL_DEFAULTS[k]) if getattr(self, k) is None
                      else getattr(self, k)) for k in GLOBAL_DEFAULTS}
        return dataclasses.replace(self, **filled)

    @property
    def epochs(self) -> float:
        """The epoch limit: ``max_epochs``, else DEFAULT_EPOCHS, or none (infinity) when the run
        is counted in steps (``max_steps`` given alone)."""
        if self.max_epochs is not None:
            return self.max_epochs
        return DEFAULT_EPOCHS if self.max_steps is None else math.inf

    def trackers(self) -> list[str]:
        """The trackers to send to, each once (``--tensorboard`` is ``--tracker tensorboard``)."""
        names = [n.strip() for n in self.tracker.split(",") if n.strip()] + ["tensorboard"] * self.tensorboard
        return list(dict.fromkeys(names))

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step over every rank: batch x ranks x accumulation (x replica
        groups under --fault-tolerance torchft, ``world_size`` being one group's)."""
        return self.batch_size * world_size * self.grad_accum * self.replica_groups

    @property
    def adam_betas(self) -> tuple[float, float]:
        """--betas as two numbers, each in [0, 1); ConfigError (one line) otherwise."""
        try:
            first, second = (float(part) for part in self.betas.split(","))
        except ValueError:
            raise ConfigError(f"--betas needs two numbers B1,B2 such as 0.9,0.95, got {self.betas!r}") from None
        if not (0 <= first < 1 and 0 <= second < 1):
            raise ConfigError(f"--betas {self.betas}: each must be in [0, 1), e.g. 0.9,0.95")
        return first, second

    def log_interval(self, total_steps: int | None) -> int:
        """--log-every as resolved for a run of ``total_steps`` (None: unknown): the setting, else
        LOG_EVERY, or a step record LOG_TIMES times in a run shorter than LOG_TIMES x LOG_EVERY steps."""
        if self.log_every is not None:
            return self.log_every
        if total_steps is None or total_steps >= LOG_EVERY * LOG_TIMES:
            return LOG_EVERY
        return max(1, total_steps // LOG_TIMES)

    @property
    def sync_settings(self) -> tuple[int, float, float]:
        """--sync-every, --outer-lr and --outer-momentum as resolved (the defaults where unset)."""
        return (SYNC_EVERY if self.sync_every is None else self.sync_every,
                OUTER_LR if self.outer_lr is None else self.outer_lr,
                OUTER_MOMENTUM if self.outer_momentum is None else self.outer_momentum)

    def with_run_dir(self) -> RunConfig:
        """This config with its run dir resolved: the given one, else ``default_run_dir``."""
        return self if self.run_dir else dataclasses.replace(self, run_dir=default_run_dir(self))

    def math_fingerprint(self, world_size: int) -> dict[str, Any]:
        """The settings a snapshot must share with the run that resumes it."""
        values = {k: getattr(self, k) for k in MATH_FIELDS if k != "global_batch"}
        values["global_batch"] = self.global_batch(world_size)
        values["max_epochs"] = self.epochs  # as resolved: 0.3's snapshots hold 5, the default
        if self.lr_schedule == "constant" and self.warmup_steps == 0:
            del values["max_epochs"], values["max_steps"]  # a longer run only extends a constant schedule
        elif self.max_steps is None:
            del values["max_steps"]  # snapshots from before the setting existed match
        if not self.sync_batchnorm:
            del values["sync_batchnorm"]  # snapshots from before the setting existed match
        for name, default in MATH_OMITTED_AT.items():  # (the same: snapshots from before them match)
            if values[name] == default:
                del values[name]
        if self.sync != "every-step":  # (every-step: snapshots from before the setting existed match)
            every, outer_lr, outer_momentum = self.sync_settings
            # --replicas as given (None: one group per node, which follows the nodes on another world
            # size): another count of groups on the same ranks would load one group's inner optimizer
            # state into another's ranks, or none, and the meetings would average other weights
            values.update(sync=self.sync, sync_every=every, replicas=self.replicas,
                          **({"outer_lr": outer_lr, "outer_momentum": outer_momentum} if self.sync == "diloco" else {}))
        values.update(ema=self.ema, ema_every=self.ema_every if self.ema else 1,
                      keep_best=":".join(watched_metric(self.keep_best)) if self.keep_best.strip() else "")
        return values

    def identity(self) -> dict[str, Any]:
        """The settings that say which run this is (the default run dir is named after them):
        those set to other than their default, so a setting a later version adds, left at its
        default, keeps every run's default run dir."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in NOT_IDENTITY and getattr(self, f.name) != f.default}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(RunConfig)}


# The built-in optimizer's settings (optim.build_optimizer): a task's make_optimizer replaces them.
OPTIMIZER_SETTINGS = ("optimizer", "momentum", "weight_decay", "betas", "eps")


def unset_settings(cfg: RunConfig, names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``names`` that ``cfg`` (as given, before the task's defaults) leaves at their defaults."""
    return tuple(name for name in names if getattr(cfg, name) == FIELDS[name].default)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Other trainers' names for our settings (nanoGPT's config keys, Lightning's and HF Trainer's
# arguments): an unknown flag spelled as there is answered with ours.
NAMES_ELSEWHERE = {
    "log_interval": "log_every", "logging_steps": "log_every", "log_every_n_steps": "log_every",
    "log_freq": "log_every", "eval_iters": "eval_batches", "limit_val_batches": "eval_batches",
    "eval_interval": "eval_every_steps", "eval_steps": "eval_every_steps", "val_check_interval": "eval_every_steps",
    "max_iters": "max_steps", "num_train_epochs": "max_epochs", "learning_rate": "lr",
    "warmup_iters": "warmup_steps", "lr_decay_iters": "max_steps", "decay_lr": "lr_schedule",
    "beta1": "betas", "beta2": "betas", "adam_beta1": "betas", "adam_beta2": "betas", "adam_epsilon": "eps",
    "grad_clip": "clip_grad", "max_grad_norm": "clip_grad", "gradient_clip_val": "clip_grad",
    "gradient_accumulation_steps": "grad_accum", "accumulate_grad_batches": "grad_accum",
    "per_device_train_batch_size": "batch_size", "out_dir": "run_dir", "output_dir": "run_dir",
    "dtype": "precision", "save_steps": "save_every", "lr_scheduler_type": "lr_schedule",
}


def nearest_flag(name: str) -> str | None:
    """The flag a mistyped or borrowed setting name most likely meant (``--log_interval`` ->
    ``--log-every``), or None when none is close."""
    import difflib

    key = name.strip().lstrip("-").replace("-", "_")
    if key in NAMES_ELSEWHERE:
        return flag(NAMES_ELSEWHERE[key])
    close = difflib.get_close_matches(key, list(FIELDS), n=1, cutoff=0.6)
    return flag(close[0]) if close else None


def default_run_dir(cfg: RunConfig) -> str:
    """``runs/TASK-HASH``: the same settings give the same folder, other settings another."""
    return default_name(cfg.task, cfg.identity())


def watched_metric(spec: str) -> tuple[str, str]:
    """``--keep-best METRIC[:min|max]`` as (the record's key, ``min`` or ``max``): a name without
    ``eval_`` gets it; min by default for names ending in ``loss``, else max."""
    name, _, mode = spec.strip().partition(":")
    name = name.strip()
    if not name or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ConfigError(f"--keep-best {spec!r}: give METRIC[:min|max], an evaluation figure such as eval_loss")
    key = name if name.startswith("eval_") else f"eval_{name}"
    mode = mode.strip() or ("min" if key.endswith("loss") else "max")
    if mode not in ("min", "max"):
        raise ConfigError(f"--keep-best {spec!r}: {mode!r} is neither min nor max; write e.g. eval_accuracy:max")
    return key, mode
