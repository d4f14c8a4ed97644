"""One rank's life: find its place, build the task, join the process group, train, leave.

``run_rank`` is the entry point both for ranks that ddptrain starts itself (through torch's
elastic launcher, via ``rank_entry``) and for a process started by torchrun or srun.

A rank connects to the job's store and starts its watchdog before anything else, so a rank
that fails or hangs at any point, start-up included, is noticed by the others. A rank that
fails tells the others through the store (they stop within a second instead of waiting for
a timeout), writes its traceback where the launcher finds it (``@record``), and exits at
once (failures.hard_exit).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from . import tasks
from .config import ConfigError, RunConfig
from .dist import connect_store, hosts_store, joined, resolve_device_kind
from .environments import detect
from .failures import PeerFailed, hard_exit, record_error
from .preemption import PREEMPTED_EXIT_CODE
from .report import say
from .tasks.protocol import TaskFactory
from .trainer import Trainer
from .watchdog import NullWatchdog, Watchdog

# What a rank returns: (status, message). The launcher prints rank 0's message.
Outcome = tuple[str, str]
EXIT_CODES = {"finished": 0, "already_finished": 0, "config_error": 2, "preempted": PREEMPTED_EXIT_CODE}


_watchdog: Watchdog | None = None  # this process's rank's watchdog (one rank per process)


class ErrorFileOnce(ErrorHandler):
    """``@record``'s handler, writing through failures.record_error: once per process."""

    def record_exception(self, e: BaseException) -> None:
        record_error(e)


def rank_entry(cfg: RunConfig, factory: TaskFactory | None) -> Outcome:
    """What ddptrain's own launcher starts in every local rank."""
    try:
        return run_rank(cfg, factory)
    except BaseException:  # @record has written the error file (or the watchdog thread has)
        leave(1)
        raise  # not reached


def leave(code: int) -> None:
    """End this rank's process now, after a failure (see failures.hard_exit)."""
    if _watchdog is not None:
        _watchdog.exit_process(code)
    hard_exit(code)


@functools.partial(record, error_handler=ErrorFileOnce())
def run_rank(cfg: RunConfig, factory: TaskFactory | None = None, local_rank_arg: int | None = None) -> Outcome:
    env = detect(local_rank_arg=local_rank_arg)
    show_warnings_with_rank(env.rank)
    run_dir = Path(cfg.run_dir)  # resolved by the caller (api.execute)
    write_pid_file(run_dir, env.rank)
    device_kind, backend = resolve_device_kind(cfg.device, cfg.backend, env.local_world_size)
    store = connect_store(env, cfg.timeout)
    global _watchdog
    if env.world_size > 1:
        _watchdog = watchdog = Watchdog(env, cfg.timeout, run_dir, hosts_store=hosts_store(env)).start()
    else:
        watchdog = NullWatchdog()
    try:
        watchdog.phase("start-up: building the task")
        task = tasks.build(cfg, factory)
        check_batch_fits(len(task.train_set), env.world_size, cfg.batch_size)  # type: ignore[arg-type]
        with joined(env, device_kind, backend, cfg.timeout, store, watchdog) as ctx:
            status = Trainer(task, cfg, ctx).fit()
    except ConfigError as error:  # the same on every rank: each returns it, the launcher says it once
        watchdog.report_failure(error)
        watchdog.stop()
        return "config_error", str(error)
    except BaseException as error:
        if watchdog.acting.is_set():  # the watchdog thread reports a verdict (a hang) and ends the process
            watchdog.exit_process(1)
        if not watchdog.report_failure(error) and not isinstance(error, PeerFailed):
            # Another rank failed first; this one only felt it (a closed connection, say).
            raise PeerFailed(f"rank {env.rank} stopped after another rank failed: "
                             f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error
        raise
    watchdog.stop()
    Path(run_dir / "pids" / f"rank-{env.rank}.pid").unlink(missing_ok=True)
    return status, outcome_message(status, cfg)


def outcome_message(status: str, cfg: RunConfig) -> str:
    if status == "preempted":
        return (f"stopped by a signal at a step boundary; snapshot saved in {cfg.run_dir}/snapshots; "
                "run the same command to resume")
    if status == "already_finished":
        return (f"{cfg.run_dir} holds a run that already finished {cfg.max_epochs} epoch(s); its model is "
                f"{cfg.run_dir}/model.pt. To train it longer, pass a larger --max-epochs; to train afresh, "
                "pass --resume never or another --run-dir")
    return f"model saved to {cfg.run_dir}/model.pt"


def show_warnings_with_rank(rank: int) -> None:
    """Warnings print as one line that says which rank raised them."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        say(f"ddptrain: rank {rank}: {category.__name__}: {message}", file or sys.stderr)
    warnings.showwarning = show


def check_batch_fits(dataset_len: int, world_size: int, batch_size: int) -> None:
    share = -(-dataset_len // world_size)
    if batch_size > share:
        raise ConfigError(f"--batch-size {batch_size} is larger than a rank's share of the data "
                          f"({dataset_len} samples / {world_size} ranks = {share}); use "
                          f"--batch-size {share} or less")


def write_pid_file(run_dir: Path, rank: int) -> Path:
    """``RUN_DIR/pids/rank-N.pid``: which process is rank N (to signal it, or find it)."""
    folder = run_dir / "pids"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank}.pid"
    path.write_text(f"{os.getpid()}\n")
    return path


def exit_for(outcome: Outcome, is_main: bool) -> int:
    """Print the outcome's message (rank 0) and return the process exit status."""
    status, message = outcome
    if is_main and message:
        prefix = "ddptrain: error: " if status == "config_error" else "ddptrain: "
        say(prefix + message, sys.stderr if status not in ("finished", "already_finished") else sys.stdout)
    return EXIT_CODES[status]
