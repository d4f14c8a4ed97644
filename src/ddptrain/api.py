"""``ddptrain.fit``: the same path as ``ddptrain train``, from Python.

``prepare`` turns a task and options (keyword arguments, a settings file, or the command
line's flags) into a validated RunConfig; ``execute`` runs it: as one rank when a launcher
(torchrun, srun, torch.distributed.launch) started this process, else by starting the local
ranks through torch's elastic launcher. Both ``fit`` and the command line go through both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from .errors import ConfigError, Stopped, TrainingFailed  # noqa: F401 - ddptrain.api's names too
from .run_dir import RunDir
from .settings import RunConfig
from .settings.checks import parse_nproc, validate
from .settings.parsing import from_options, read_settings_file, setting_name

if TYPE_CHECKING:  # torch is imported only once the settings are known to be good
    from .launch.rank import Outcome
    from .tasks.protocol import TaskFactory


def prepare(task: str | TaskFactory | None, options: Mapping[str, Any],
            config_file: str | None = None) -> tuple[RunConfig, TaskFactory | None]:
    """A validated RunConfig and the task factory (None: ``cfg.task`` names it)."""
    settings: dict[str, Any] = {}
    if config_file:
        settings = read_settings_file(config_file)
        from_options(settings, where=f"--config {config_file}:")  # its mistakes name the file
        settings = {setting_name(key): value for key, value in settings.items()}  # flags below win
    settings.update(options)
    factory = None
    if callable(task):
        factory, settings["task"] = task, factory_name(task)
    elif task is not None:
        settings["task"] = task
    cfg = from_options(settings)
    validate(cfg)
    if cfg.run_dir:  # a URL that cannot work: one line before the task's import pulls in torch
        RunDir.of(cfg.run_dir).check_url()
    if cfg.trackers():
        from .observe.trackers import check_installed, check_settings

        check_installed(cfg.trackers())
        check_settings(cfg.trackers())
    if factory is None:
        from . import tasks

        tasks.resolve_factory(cfg.task)  # import errors before any rank starts
    return cfg, factory


def factory_name(factory: TaskFactory) -> str:
    """``module:qualname`` of a factory, the name ``--task`` would give it (a callable object or
    a functools.partial has no ``__qualname__``: its type's name stands in)."""
    module = getattr(factory, "__module__", None) or "__main__"
    return f"{module}:{getattr(factory, '__qualname__', type(factory).__name__)}"


def execute(cfg: RunConfig, factory: TaskFactory | None, local_rank_arg: int | None = None, *,
            leave_on_failure: bool = False) -> tuple[Outcome, int]:
    """Run the job: as this rank under a launcher, else start the local ranks here. Returns the
    outcome and this process's rank (0 for the local launcher: it speaks for the job).
    ``leave_on_failure``: a rank that fails says so and exits at once (the command line)."""
    from .launch.environments import detect

    env = detect(local_rank_arg=local_rank_arg)
    env.validate()
    cfg = cfg.with_run_dir()
    home = RunDir.of(cfg.run_dir)
    home.check()  # a store's URL, client, credentials and bucket: one line, before any rank starts
    home.create()
    if cfg.fault_tolerance == "torchft":  # the lighthouse answers: one line, before any rank starts
        from .resilience.lighthouse import check_lighthouse

        check_lighthouse(cfg.lighthouse)
    if cfg.resume not in ("auto", "never"):
        from .snapshots.restore import check_resume_path
        check_resume_path(cfg.resume)
    if not env.starts_ranks:  # torchrun or srun started this process
        from .launch.rank import run_rank, run_rank_or_leave
        run = run_rank_or_leave if leave_on_failure else run_rank
        return cast("Outcome", run(cfg, factory, local_rank_arg)), env.rank  # (@record's None: SystemExit(0))
    from .launch.group import check_comm_hook, resolve_device_kind
    from .launch.local import auto_nproc, launch_local, new_job_id
    from .observe.goodput import exited, timeline_size
    from .resilience.hold import RunDirHold

    nproc = parse_nproc(cfg.nproc) or auto_nproc(cfg.device)
    device_kind, backend = resolve_device_kind(cfg.device, cfg.backend, nproc)
    check_comm_hook(cfg.comm_hook, backend)
    if line := env.start_line(nproc):  # a Kubeflow pod: one node of several
        from .console import say

        say(line)
    node = env.node_rank  # the first node holds the run dir
    hold = RunDirHold(home, new_job_id()).acquire() if node == 0 else None
    timeline = timeline_size(home.local)
    try:
        return launch_local(cfg, nproc, device_kind, factory, env), node * nproc
    finally:
        if hold is not None:  # the attempt, if one began, ends here, its ranks gone (goodput's wall)
            exited(home.local, since=timeline)
            hold.release()


def fit(task: str | TaskFactory, *, config: str | None = None, **options: Any) -> dict[str, Any]:
    """Train ``task`` and return the run's summary (what ``ddptrain report`` prints).

    ``task``: a factory (a function ``cfg -> Task``, which may live in your script's
    ``__main__``), a built-in name, or ``"MODULE:FUNC"``. ``options``: the flags of
    ``ddptrain train`` as keyword arguments (``max_epochs=5``, ``nproc=2``, ``run_dir=...``);
    ``config``: a TOML settings file or a run's config.json (keyword arguments win).

    Without a launcher it starts the local ranks itself and returns in this process; under
    torchrun or srun it runs as this rank and returns the summary on rank 0, ``{}`` elsewhere.
    Raises ConfigError (the command line's one-line message) for bad options, TrainingFailed
    when a rank fails or hangs, Stopped after a stop signal.
    """
    cfg, factory = prepare(task, options, config)
    if cfg.run_dir is None:  # a Ray Train worker's run lives in Ray's storage for the job
        from .observe.ray_train import ray_storage_run_dir

        if (in_ray := ray_storage_run_dir()) is not None:
            cfg = cfg.replace(run_dir=in_ray)
    (status, message), rank = execute(cfg, factory)
    if status == "config_error":
        raise ConfigError(message)
    if status == "preempted":
        raise Stopped(message)
    if status == "already_finished":
        from .console import say

        say(f"ddptrain: {message}")
    return summary_of(cfg) if rank == 0 else {}


def summary_of(cfg: RunConfig) -> dict[str, Any]:
    """The finished run's summary (read from its metrics.jsonl)."""
    from .observe.summary import summarize

    return summarize(RunDir.of(cfg.with_run_dir().run_dir).local)
