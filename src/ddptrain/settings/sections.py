"""The run's settings, by concern: one frozen dataclass per section, each field with its help text
and its role (roles.py: math, identity or operation), the one place a setting is declared.

A component is built from its own section (the checkpointer from ``SnapshotSettings``, the
strategy from ``ParallelSettings``, ...), plus the few facts it needs from others, passed by
name; ``RunConfig`` (run_config.py) holds every section. A flag's name is its field's, flat and
unique over every section (``--save-every`` is ``SnapshotSettings.save_every``), so the command
line, settings files, ``fit(**options)`` and a run's config.json name settings as they always
did; ``cli.py`` groups ``--help`` by section, and docs/flags.md is generated from the same fields
(``docs/make_reference.py``). docs/development.md's recipe says how to add one.
"""

from __future__ import annotations

import dataclasses
import math as _math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigError
from .roles import NEVER, Role, identity, math, operation, setting


class Section:
    """What every section is: a frozen dataclass of settings, named ``SECTION`` in RunConfig (and in
    a settings file's tables)."""

    SECTION: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Any]]  # (set by @dataclass: what dataclasses.fields reads)


DEFAULT_EPOCHS = 5  # when neither --max-epochs nor --max-steps is given
SYNC_EVERY = 50  # --sync local-sgd|diloco's default (DiLoCo's paper: 500)
# The outer step runs begun before 0.6 took when --outer-lr and --outer-momentum were left out (the
# DiLoCo paper's): their snapshots' fingerprints hold these; --sync diloco now needs both given.
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
TRACKERS = ("csv", "tensorboard", "mlflow", "wandb")  # observe/trackers.py
ADAM_BETAS, ADAM_EPS = "0.9,0.999", 1e-8  # torch's AdamW defaults
LOG_EVERY, LOG_TIMES = 10, 4  # --log-every's default: every 10 steps, or 4 times in a shorter run

# Where a setting does not count (a math role's ``unless``):
LONGER_RUN_SAME_MATH = {"lr_schedule": "constant", "warmup_steps": 0}  # the run's length: a constant rate
EVERY_STEP = {"sync": "every-step"}  # --sync's own settings, when the groups meet every step
NOT_DILOCO = {"sync": ("every-step", "local-sgd")}  # DiLoCo's outer step


@dataclass(frozen=True)
class TrainingSettings(Section):
    """What to train, for how long, on which batches, and where the run's files go."""

    SECTION: ClassVar[str] = "training"

    task: str = setting("built-in task (regression, digits) or MODULE:FUNC, a factory of your own",
                        default="regression", role=math())
    task_opt: str = setting("a setting of the task's own, NAME=VALUE (n_layer=4; repeat the flag, or a settings "
                            "file's [task-opt] table), read by its factory as cfg.task_option(NAME, DEFAULT); one "
                            "it does not read is refused", default="", pairs=True, role=math(omitted_at=""))
    max_epochs: int | None = setting(f"epochs to train (default {DEFAULT_EPOCHS}; no limit with --max-steps); 0 "
                                     "evaluates the initial model and stops", default=None, alias="--max_epochs",
                                     role=math(names_run=False, value=lambda cfg, world: cfg.epochs,
                                               unless=LONGER_RUN_SAME_MATH))
    max_steps: int | None = setting("optimizer steps to train, across epoch boundaries; with --max-epochs too, "
                                    "the first limit reached ends the run", default=None,
                                    role=math(names_run=False, omitted_at=None, unless=LONGER_RUN_SAME_MATH))
    batch_size: int = setting("samples per rank per micro-batch; the global batch is this x ranks "
                              "x --grad-accum", default=32, alias="--batch_size",
                              role=math(key="global_batch", value=lambda cfg, world: cfg.global_batch(world)))
    grad_accum: int = setting("micro-batches accumulated per optimizer step (gradients are "
                              "synchronised on the last one only)", default=1, role=math())
    seed: int = setting("seed for data, initial weights and shuffling (same on every rank)", default=0, role=math())
    workers: int = setting("DataLoader worker processes per rank, for training and evaluation "
                           "(data sets that are not in-memory tensors)", default=0, role=operation())
    run_dir: str | None = setting("where config, metrics, snapshots and model.pt go (default: "
                                  "runs/TASK-HASH, named after the task and the settings, so the "
                                  "same command finds its run again)", default=None, role=operation())

    @property
    def epochs(self) -> float:
        """The epoch limit: ``max_epochs``, else DEFAULT_EPOCHS, or none (infinity) when the run
        is counted in steps (``max_steps`` given alone)."""
        if self.max_epochs is not None:
            return self.max_epochs
        return DEFAULT_EPOCHS if self.max_steps is None else _math.inf


@dataclass(frozen=True)
class OptimizerSettings(Section):
    """The optimizer, its learning-rate schedule, and the numerics of a step."""

    SECTION: ClassVar[str] = "optim"

    lr: float | None = setting("learning rate (default: the task's, else 1e-3)", default=None,
                               role=math(), task_default=1e-3)
    optimizer: str | None = setting("optimizer (default: the task's, else sgd)",
                                    choices=("sgd", "adamw"), default=None, role=math(),
                                    task_default="sgd")
    momentum: float | None = setting("SGD momentum (default: the task's, else 0)", default=None,
                                     role=math(), task_default=0.0)
    weight_decay: float | None = setting("weight decay (default: the task's, else 0)", default=None,
                                         role=math(), task_default=0.0)
    betas: str = setting("adamw: its two decay rates, B1,B2 (nanoGPT uses 0.9,0.95 or 0.9,0.99)",
                         default=ADAM_BETAS, role=math(omitted_at=ADAM_BETAS))
    eps: float = setting("adamw: the term added to its denominator", default=ADAM_EPS, role=math(omitted_at=ADAM_EPS))
    lr_schedule: str = setting("learning-rate schedule over the optimizer steps",
                               choices=("constant", "cosine", "linear"), default="constant", role=math())
    warmup_steps: int = setting("steps of linear warm-up before the schedule", default=0, role=math())
    decay_fraction: float | None = setting("decay over the run's last F of its steps only, the rate held until then "
                                           "(warmup-stable-decay: a run resumed before its decay with a larger "
                                           "--max-steps goes on exactly; default: decay from the warm-up's end)",
                                           default=None, role=math(omitted_at=None, unless={"lr_schedule": "constant"}))
    min_lr: float = setting("the rate cosine and linear decay end at (nanoGPT's min_lr)", default=0.0,
                            role=math(omitted_at=0.0))
    precision: str = setting("autocast precision of the forward pass and the loss (fsdp: its mixed-precision policy)",
                             choices=("fp32", "bf16", "fp16"), default="fp32", role=math())
    clip_grad: float | None = setting("clip the global gradient norm to this value", default=None, role=math())

    def hparam(self, name: str) -> Any:
        """A hyper-parameter as resolved: the setting, else GLOBAL_DEFAULTS."""
        value = getattr(self, name)
        return GLOBAL_DEFAULTS[name] if value is None else value

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


@dataclass(frozen=True)
class ParallelSettings(Section):
    """How the model is spread over the ranks, and how replica groups keep one model."""

    SECTION: ClassVar[str] = "parallel"

    strategy: str = setting("ddp replicates the model on every rank; fsdp shards parameters, "
                            "gradients and optimizer state (FSDP2); hsdp shards inside each of --replicas "
                            "groups and replicates across them (FSDP2 on a 2-D mesh)",
                            choices=("ddp", "fsdp", "hsdp"), default="ddp", role=identity())
    replicas: int | None = setting("hsdp, --sync local-sgd|diloco: the number of replica groups (the ranks split "
                                   "into that many groups of consecutive ranks; under hsdp each holds the whole "
                                   "model sharded over its ranks); default: one per node", default=None,
                                   # the groups' count is in the math of --sync (each group's own optimizer state and
                                   # the meetings' average), not of every-step hsdp (its layout alone)
                                   role=math(unless=EVERY_STEP, since="0.5"))
    tp: int = setting("tensor parallelism with --strategy fsdp: groups of N consecutive ranks split the layers "
                      "the task's Task.tp_plan names (or a Hugging Face model's own tp_plan), each group one "
                      "data-parallel rank (the batch splits over the world / N groups, FSDP2 shards across them: "
                      "docs/tensor-parallel.md)", default=1,
                      role=identity())
    reshard_after_forward: bool = setting("fsdp: free gathered parameters after the forward pass "
                                          "(less memory, one more all-gather in backward)", default=True,
                                          role=identity())
    activation_checkpointing: bool = setting("recompute each block's activations in backward "
                                             "instead of keeping them (less memory, more compute)",
                                             default=False, role=identity())
    sync: str = setting("how the replica groups keep one model: every-step (the gradients meet every step); "
                        "local-sgd (each group trains alone, DDP inside it, and every --sync-every steps the groups "
                        "average their weights); diloco (every --sync-every steps an outer Nesterov SGD step moves "
                        "the last synced weights by the groups' mean change; docs/slow-links.md)",
                        choices=("every-step", "local-sgd", "diloco"), default="every-step",
                        role=math(omitted_at="every-step"))
    sync_every: int | None = setting(f"local-sgd, diloco: optimizer steps between syncs (default {SYNC_EVERY})",
                                     default=None,
                                     role=math(value=lambda cfg, world: cfg.sync_settings[0], unless=EVERY_STEP))
    outer_lr: float | None = setting("diloco: the outer SGD's learning rate (required: no value held on every job "
                                     "measured, docs/slow-links.md; 1 with --outer-momentum 0 is local SGD)",
                                     default=None,
                                     role=math(value=lambda cfg, world: cfg.sync_settings[1], unless=NOT_DILOCO))
    outer_momentum: float | None = setting("diloco: the outer SGD's Nesterov momentum (required; 0: plain SGD)",
                                           default=None,
                                           role=math(value=lambda cfg, world: cfg.sync_settings[2], unless=NOT_DILOCO))
    comm_hook: str = setting("ddp: the gradients' communication hook (fp16, bf16: compressed all-reduce; "
                             "powersgd: low-rank)", choices=("none", "fp16", "bf16", "powersgd"), default="none",
                             role=identity())
    static_graph: bool = setting("ddp: tell DDP the graph is the same every step", default=False, role=identity())
    bucket_cap_mb: float | None = setting("ddp: gradient bucket size in MiB (default: DDP's own, 25)",
                                          default=None, role=identity())
    find_unused_parameters: bool = setting("ddp: handle parameters that get no gradient "
                                           "(slower; only for models that need it)", default=False, role=identity())
    sync_batchnorm: bool = setting("BatchNorm layers normalise with the whole global batch's statistics "
                                   "(torch's SyncBatchNorm, GPUs only); plain BatchNorm normalises each "
                                   "rank's batch", default=False, role=math(omitted_at=False))
    compile: bool = setting("torch.compile the model before wrapping it", default=False, role=identity())
    lean_cpu_memory: bool = setting("CPU ranks under glibc's allocator (fit(), or DDPTRAIN_ALLOCATOR=system): give "
                                    "every freed buffer over 1 MiB back to the OS at once (glibc's mmap threshold); "
                                    "under fsdp the peak resident memory then falls to about 0.6x, at about half the "
                                    "speed (README: FSDP); no effect under mimalloc (ddptrain train's CPU default) "
                                    "or on GPUs", default=False, role=operation())

    @property
    def sync_settings(self) -> tuple[int, float, float]:
        """--sync-every, --outer-lr and --outer-momentum as resolved (the defaults where unset)."""
        return (SYNC_EVERY if self.sync_every is None else self.sync_every,
                OUTER_LR if self.outer_lr is None else self.outer_lr,
                OUTER_MOMENTUM if self.outer_momentum is None else self.outer_momentum)


@dataclass(frozen=True)
class LaunchSettings(Section):
    """Where the ranks run when ddptrain starts them."""

    SECTION: ClassVar[str] = "launch"

    nproc: str = setting("local ranks when not under a launcher: a number, or auto "
                         "(one per GPU; 2 CPU ranks without GPUs)", default="auto", role=identity())
    device: str = setting("compute device (auto: cuda:LOCAL_RANK when every local rank has a GPU, else cpu)",
                          choices=("auto", "cpu", "cuda"), default="auto", role=identity())
    backend: str = setting("process-group backend (auto: nccl on CUDA, else gloo)",
                           choices=("auto", "gloo", "nccl"), default="auto", role=identity())


@dataclass(frozen=True)
class ResilienceSettings(Section):
    """What a failure, a hang or a bad step costs: time limits, restarts, torchft's replica groups."""

    SECTION: ClassVar[str] = "resilience"

    timeout: float = setting("seconds every rank may take to reach a collective (start-up, a step, "
                             "an evaluation) before the job stops and names the rank that did not "
                             "arrive", default=300.0, role=operation())
    max_restarts: int = setting("restarts of all local ranks after a failure (local launch; under "
                                "torchrun use its own --max-restarts)", default=0, role=operation())
    skip_nonfinite: int = setting("skip optimizer steps whose loss or gradient is not finite, on every "
                                  "rank together, and stop after this many (0: stop at the first)",
                                  default=0, role=identity())
    fault_tolerance: str = setting("torchft: this job is one replica group of --replica-groups; the groups average "
                                   "their gradients every step through torchft, and when one fails the others train "
                                   "on while it restarts and heals from a live peer (pip install 'ddptrain[ft]'; "
                                   "docs/fault-tolerance.md)", choices=("none", "torchft"), default="none",
                                   role=identity())
    replica_group: int = setting("--fault-tolerance torchft: this job's replica group, 0 to --replica-groups - 1",
                                 default=0, role=identity())
    replica_groups: int = setting("--fault-tolerance torchft: how many replica groups train the run (each a job "
                                  "of its own, with the same settings)", default=1,
                                  role=math(key="global_batch", value=lambda cfg, world: cfg.global_batch(world)))
    lighthouse: str = setting("--fault-tolerance torchft: the torchft lighthouse every group reaches, "
                              "http://HOST:PORT (default: TORCHFT_LIGHTHOUSE; `ddptrain lighthouse` starts one)",
                              default="", role=operation())


@dataclass(frozen=True)
class SnapshotSettings(Section):
    """When snapshots are written, how many are kept, and where a run resumes."""

    SECTION: ClassVar[str] = "snapshots"

    save_every: int = setting("also write a snapshot every N optimizer steps (0: off)", default=0, role=operation())
    save_seconds: float = setting("write a snapshot when this many seconds of training passed since "
                                  "the last one (stretched so snapshots cost at most 2%% of training "
                                  "time; 0: off); snapshots are also written at the end and on a "
                                  "stop signal", default=60.0, role=operation())
    mttf_hours: float = setting("the job's mean time between failures, in hours: snapshots by time then "
                                "come every sqrt(2 x a snapshot's blocking time x MTTF) s, the interval "
                                "that loses least to snapshots and redone steps (Young's rule), in place "
                                "of --save-seconds, which times the first (0: off)", default=0.0, role=operation())
    keep: int = setting("snapshots kept in RUN_DIR/snapshots (the oldest removed once a new one is committed)",
                        default=2, role=operation())
    resume: str = setting("auto (newest complete snapshot in the run dir), never (a fresh start; an "
                          "earlier run's files there are moved aside; the job's own restarts resume its "
                          "snapshots), or a snapshot path", default="auto", role=operation())


@dataclass(frozen=True)
class EvaluationSettings(Section):
    """Evaluations, the best weights, the weights' average, and a fine-tune's first weights."""

    SECTION: ClassVar[str] = "evaluation"

    eval_every: int = setting("evaluate every N epochs (and at the end) when the task has an "
                              "evaluation set; 0: only at the end", default=1, role=operation())
    eval_every_steps: int = setting("also evaluate every N optimizer steps (0: off)", default=0, role=operation())
    eval_at_start: bool = setting("also evaluate the initial weights before step 1 of a fresh run (nanoGPT's step-0 "
                                  "val loss; a resumed run does not again)", default=False, role=operation())
    eval_batches: int = setting("evaluate on N batches of --batch-size, the same samples at every evaluation (a "
                                "subset drawn once from --seed, so figures compare across the run and across world "
                                "sizes; nanoGPT's eval_iters); 0: the whole evaluation set", default=0,
                                role=operation())
    final_eval: str = setting("the run's last evaluation: full (the whole evaluation set, whatever --eval-batches "
                              "says) or same (--eval-batches' subset, like the others)",
                              choices=("full", "same"), default="full", role=operation())
    keep_best: str = setting("keep RUN_DIR/best/model.pt, the weights of the best evaluation by METRIC[:min|max] "
                             "(an eval_* figure, e.g. eval_loss; min for names ending in loss, else max)", default="",
                             # (in snapshots since 0.5: best/'s verdicts go on by the same figure; not in run dir names)
                             role=math(names_run=False, value=lambda cfg, world: _watched(cfg.keep_best), since="0.5"))
    early_stop: int = setting("end the run after N evaluations in a row without an improvement of the --keep-best "
                              "metric (0: off)", default=0, role=operation())
    early_stop_delta: float = setting("the least change of the --keep-best metric that counts as an improvement "
                                      "for --early-stop", default=0.0, role=operation())
    ema: float = setting("keep an exponential moving average of the weights with this decay (0: off; e.g. 0.999): "
                         "evaluated beside the weights (ema_eval_*), in every snapshot, written to "
                         "RUN_DIR/ema/model.pt", default=0.0, role=math(names_run=False, since="0.5"))
    ema_every: int = setting("update the --ema average every N optimizer steps", default=1,
                             role=math(names_run=False, unless={"ema": 0.0}, since="0.5"))
    init_from: str = setting("a fresh run's first weights: a model.pt or .safetensors file, a snapshot, another run "
                             "dir, or a Hugging Face folder (weights only; a resumed run ignores it)", default="",
                             role=identity())
    init_from_partial: bool = setting("--init-from loads the tensors that match this model and names the rest "
                                      "(default: any difference is an error)", default=False, role=identity())
    init_optimizer: bool = setting("--init-from a snapshot (or a run dir: its newest) loads its optimizer's state "
                                   "too (AdamW's moments and step counts), under this run's rates and schedule: a "
                                   "finished run trained on under a new schedule", default=False, role=identity())


@dataclass(frozen=True)
class ObservationSettings(Section):
    """What a run shows while it trains: step records, the console, trackers, profiles, plots."""

    SECTION: ClassVar[str] = "observe"

    log_every: int | None = setting(f"a step record every N optimizer steps: the mean training loss over them (every "
                                    f"rank's, as the optimizer saw it), the rate, the gradient norm and training-only "
                                    f"throughput, in metrics.jsonl, the trackers and, without a progress bar, the "
                                    f"console (default: {LOG_EVERY}, or {LOG_TIMES} times in a shorter run; 0: off)",
                                    default=None, role=operation())
    log_ranks: bool = setting("every rank prints the tutorial's per-epoch line", default=False, role=operation())
    progress: bool | None = setting("progress bar on rank 0 (default: when stderr is a terminal)",
                                    default=None, role=operation())
    tensorboard: bool = setting("write TensorBoard event files into the run dir (--tracker tensorboard)", default=False,
                                role=operation())
    tracker: str = setting(f"send metrics, settings and files to experiment trackers, comma-separated: "
                           f"{', '.join(TRACKERS)} (MLflow reads MLFLOW_TRACKING_URI, W&B its WANDB_* variables)",
                           default="", many=True, role=operation())
    peak_tflops: float | None = setting("one device's peak TFLOP/s, for MFU (default: a table of GPUs' dense "
                                        "bf16 peaks; none on CPU)", default=None, role=operation())
    profile: int = setting("record steps 2..N+1 with torch.profiler: RUN_DIR/profile/rank-R.json (Chrome / "
                           "Perfetto traces); 0: off", default=0, role=operation())
    plot: bool = setting("draw RUN_DIR/curves.png at the end (matplotlib; 0.5-1 s, so off by default: "
                         "`ddptrain report RUN_DIR` draws it any time)", default=False, role=operation())

    def trackers(self) -> list[str]:
        """The trackers to send to, each once (``--tensorboard`` is ``--tracker tensorboard``)."""
        names = [n.strip() for n in self.tracker.split(",") if n.strip()] + ["tensorboard"] * self.tensorboard
        return list(dict.fromkeys(names))

    def log_interval(self, total_steps: int | None) -> int:
        """--log-every as resolved for a run of ``total_steps`` (None: unknown): the setting, else
        LOG_EVERY, or a step record LOG_TIMES times in a run shorter than LOG_TIMES x LOG_EVERY steps."""
        if self.log_every is not None:
            return self.log_every
        if total_steps is None or total_steps >= LOG_EVERY * LOG_TIMES:
            return LOG_EVERY
        return max(1, total_steps // LOG_TIMES)


# The sections in --help's and docs/flags.md's order.
SECTIONS: tuple[type[Section], ...] = (TrainingSettings, OptimizerSettings, ParallelSettings, LaunchSettings,
                                       ResilienceSettings, SnapshotSettings, EvaluationSettings, ObservationSettings)

# Every setting by its (flag's) name, section by section; the section that holds it; its role.
FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for s in SECTIONS for f in dataclasses.fields(s)}
SECTION_OF: dict[str, str] = {f.name: s.SECTION for s in SECTIONS for f in dataclasses.fields(s)}


def roles_of(fields: dict[str, dataclasses.Field[Any]]) -> dict[str, Role]:
    """Each setting's role; TypeError naming those that declare none."""
    missing = [name for name, f in fields.items() if not isinstance(f.metadata.get("role"), Role)]
    if missing:  # (a contributor's first run says it, before anything can resume under a wrong role)
        raise TypeError(f"setting(s) {', '.join(missing)} declare no role: give setting(..., role=math() | "
                        "identity() | operation()) (settings/roles.py says which)")
    return {name: f.metadata["role"] for name, f in fields.items()}


ROLES: dict[str, Role] = roles_of(FIELDS)

# Hyper-parameters a task may choose defaults for (``Task.defaults``), and the defaults when it does not.
GLOBAL_DEFAULTS: dict[str, Any] = {name: f.metadata["task_default"] for name, f in FIELDS.items()
                                   if f.metadata.get("task_default", NEVER) is not NEVER}


# The built-in optimizer's settings (optim.build_optimizer): a task's make_optimizer replaces them, and
# config.json then shows those the user left unset as null.
OPTIMIZER_SETTINGS = ("optimizer", "momentum", "weight_decay", "betas", "eps")


def flag(name: str) -> str:
    """A setting's flag: ``save_every`` -> ``--save-every``."""
    return "--" + name.replace("_", "-")


def section_purpose(section: type[Section]) -> str:
    """A section's line of purpose: its docstring's."""
    return (section.__doc__ or "").strip().splitlines()[0]


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


def _watched(spec: str) -> str:
    """--keep-best as the fingerprint holds it: METRIC:MODE, or "" when off."""
    return ":".join(watched_metric(spec)) if spec.strip() else ""
