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
import gc
import math
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, cast

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from .. import tasks
from ..comm import DistContext, round_prefix
from ..console import native_stderr_to, reclaim_console, say
from ..data import is_stream
from ..errors import ConfigError, PeerFailed, PeerStuck
from ..observe.ray_train import ray_restarted
from ..resilience import flight
from ..resilience.failures import COLLECTIVE_NOTE, hard_exit, lost_peer, record_error
from ..resilience.hold import RunDirHold, job_id
from ..resilience.stop_signals import PREEMPTED_EXIT_CODE
from ..resilience.watchdog import PERIOD_S, Watchdog
from ..run_dir import RunDir, snapshot_name
from ..schedules import stable_end
from ..settings import RunConfig
from ..settings.sections import LONGER_RUN_SAME_MATH
from ..snapshots.files import snapshot_dir
from ..tasks.protocol import Task, TaskFactory
from ..trainer import Trainer
from .environments import Environment, detect
from .group import connect_store, hosts_store, joined, resolve_device_kind

# What a rank returns: (status, message). The launcher prints rank 0's message.
Outcome = tuple[str, str]
PR_SET_PDEATHSIG = 1  # prctl(2)
EXIT_CODES = {"finished": 0, "already_finished": 0, "ended_elsewhere": 0, "config_error": 2,
              "preempted": PREEMPTED_EXIT_CODE}


_watchdog: Watchdog | None = None  # this process's rank's watchdog (one rank per process)
_hold: RunDirHold | None = None  # rank 0's hold on the run dir, under torchrun / srun


class ErrorFileOnce(ErrorHandler):
    """``@record``'s handler, writing through failures.record_error: once per process."""

    def record_exception(self, e: BaseException) -> None:
        record_error(e)


def rank_entry(cfg: RunConfig, factory: TaskFactory | None) -> Outcome:
    """What ddptrain's own launcher starts in every local rank."""
    # A forked rank holds copies of the launcher's objects, among them garbage such as an
    # earlier attempt's rendezvous store after a restart: collecting that here would join its
    # server thread, which only exists in the launcher, and hang forever (seen in a restart
    # test: a rank stuck in LibUVStoreDaemon's destructor). The rank's GC leaves them alone.
    gc.freeze()
    reclaim_console()  # the launcher sent its native stderr to its log; the rank sends its own to its own
    die_with_launcher()
    try:
        outcome = cast(Outcome, run_rank(cfg, factory))  # (@record's None is for SystemExit(0) only)
    except BaseException:  # @record has written the error file (or the watchdog thread has)
        leave(1)
        raise  # not reached
    leave_once_parked()
    return outcome


def die_with_launcher() -> None:
    """A local rank ends when the process that launched it dies, even by SIGKILL (Linux's
    parent-death signal): no orphan keeps training in a run dir whose job is gone."""
    launcher = int(os.environ.get("DDPTRAIN_LAUNCHER_PID", "0"))
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: no such signal
        return
    if launcher and os.getppid() != launcher:  # it died before the line above
        hard_exit(1)


def leave_once_parked(grace_s: float = 0.5) -> None:
    """Let this process end once torch's launcher has this rank's result.

    torch's elastic multiprocessing parks a rank that returned (``_wrap``: the result goes on
    a queue, then ``queue_finished_reading_event.wait()``) until its launcher, having read
    every rank's result, sets the event; a launcher that is itself stopping (a stop signal
    reached ``ddptrain train`` or a ``fit()`` script) never does, and kills the ranks after
    30 s. The result is in the queue's pipe by then, readable after this process is gone, so
    a rank parked for ``grace_s`` sets the event itself. (Setting it, not exiting: a process
    that dies while waiting on a multiprocessing Event deadlocks the next ``set()``.)

    The thread is not a daemon: the process ends only after it has (it stops once the main
    thread has). As a daemon, a rank woken by another process's ``set()`` could end while its
    thread, queued behind it for the event's lock, had just taken it; nobody ever released it,
    and a peer rank hung on it until the launcher's SIGKILL 30 s later (a launcher ending
    normally, for ever). tests/unit/test_parked_ranks.py makes that happen."""
    main_thread = threading.main_thread()

    def parked_on() -> Any:
        """The event the main thread is parked on in torch's ``_wrap``, or None."""
        frame = sys._current_frames().get(main_thread.ident)  # type: ignore[arg-type]  # the main thread's ident is set
        while frame is not None:
            caller = frame.f_back
            if (frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("synchronize.py")
                    and caller is not None and caller.f_code.co_name == "_wrap"):
                return caller.f_locals.get("queue_finished_reading_event")
            frame = caller
        return None

    def watch() -> None:
        since = None
        while main_thread.is_alive():  # (not after threading's shutdown has begun: it joins this thread)
            event = parked_on()
            now = time.monotonic()
            since = (since or now) if event is not None else None
            if since is not None and now - since >= grace_s:
                event.set()
                return
            time.sleep(0.05)

    threading.Thread(target=watch, name="ddptrain-exit", daemon=False).start()


def leave(code: int) -> None:
    """End this rank's process now, after a failure (see failures.hard_exit)."""
    if _watchdog is not None:
        _watchdog.exit_process(code)
    hard_exit(code)


def run_rank_or_leave(cfg: RunConfig, factory: TaskFactory | None = None,
                      local_rank_arg: int | None = None) -> Outcome:
    """``ddptrain train`` as one rank under torchrun/srun: on failure, say so here (srun has no
    error files) and exit at once, without tearing down a process group whose peers may be gone."""
    try:
        return cast(Outcome, run_rank(cfg, factory, local_rank_arg))  # (@record's None: SystemExit(0) only)
    except ConfigError:
        raise
    except BaseException as error:
        if isinstance(error, (PeerFailed, PeerStuck)):
            say(f"ddptrain: {error}", sys.stderr)
        else:
            rank = detect(local_rank_arg=local_rank_arg).rank
            say(f"ddptrain: rank {rank} failed; its traceback:\n{traceback.format_exc().rstrip()}", sys.stderr)
        leave(1)
        raise  # not reached


@functools.partial(record, error_handler=ErrorFileOnce())
def run_rank(cfg: RunConfig, factory: TaskFactory | None = None, local_rank_arg: int | None = None) -> Outcome:
    env = detect(local_rank_arg=local_rank_arg)
    show_warnings_with_rank(env.rank)
    if env.local_rank == 0 and (line := env.shared_store_warning()):  # once on every node
        say(f"ddptrain: {line}", sys.stderr)
    home = RunDir.of(cfg.run_dir)  # resolved by the caller (api.execute)
    with native_stderr_to(home.local / "logs" / f"rank-{env.rank}.stderr"):  # torch's C++ warnings
        return _run_rank(cfg, factory, env, home)


def _run_rank(cfg: RunConfig, factory: TaskFactory | None, env: Environment, home: RunDir) -> Outcome:
    run_dir = home.local  # a store's run dir: this machine's mirror
    device_kind, backend = resolve_device_kind(cfg.device, cfg.backend, env.local_world_size)
    store = connect_store(env, cfg.timeout)
    global _watchdog
    # (one rank: no thread until training begins, then its stall watch, resilience/stall.py)
    _watchdog = watchdog = Watchdog(env, cfg.timeout, run_dir, hosts_store=hosts_store(env)).start()
    try:
        watchdog.phase("start-up: taking the run dir (one job per run dir)")
        hold_run_dir(env.rank, home, store)  # before this job touches anything in it
        cfg = own_restart(cfg, run_dir)
        write_pid_file(run_dir, env.rank)
        watchdog.phase("start-up: building the task")
        task = tasks.build(cfg, factory)
        if not is_stream(task.train_set):
            check_batch_fits(len(task.train_set), env.world_size, cfg.batch_size)  # type: ignore[arg-type]  # map-style: it has a length
        with joined(env, device_kind, backend, cfg.timeout, store, watchdog) as ctx:
            status, reached = train(task, cfg, ctx)
    except ConfigError as error:  # the same on every rank: each returns it, the launcher says it once
        watchdog.report_failure(error)
        watchdog.stop()
        return "config_error", str(error)
    except BaseException as error:
        if watchdog.acting.is_set():  # the watchdog thread reports a verdict (a hang) and ends the process
            watchdog.exit_process(1)
        reported = as_reported(error, env.rank, watchdog)
        if lost_peer(error):
            # The launcher may stop this rank any moment now: its report goes first. (A peer that
            # posted its stack for a hang's verdict and left breaks this rank's collective too:
            # the job's verdict is then the hang's, which the watchdog thread answers within a
            # period. Any other verdict: nothing to wait for, the rank leaves at once.)
            record_error(reported)
            if watchdog.answers_a_hang and watchdog.acting.wait(2 * PERIOD_S):
                watchdog.exit_process(1)
        if reported is error:
            raise
        raise reported from error
    finally:
        if _hold is not None:  # the job's run dir is free again (after a failure: before the exit)
            _hold.release()
    watchdog.stop()
    pid_file(run_dir, env.rank).unlink(missing_ok=True)
    return status, outcome_message(status, cfg, reached)


def as_reported(error: BaseException, rank: int, watchdog: Watchdog) -> BaseException:
    """The error this rank reports, noted with the collective it was in (flight.py). A rank
    that was not the first of the job to fail only felt another's failure (a closed
    connection, say): PeerFailed says so."""
    collective = flight.last_entered()
    if collective is not None:
        error.add_note(f"{COLLECTIVE_NOTE}{collective.describe()}")
    if watchdog.report_failure(error) or isinstance(error, PeerFailed):
        return error
    where = f" (in {collective.describe()})" if collective is not None else ""
    return PeerFailed(f"rank {rank} stopped after another rank failed{where}: "
                      f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")


def train(task: Task, cfg: RunConfig, ctx: DistContext) -> tuple[str, tuple[int, int]]:
    """The Trainer's outcome and where the run stands (epoch, global step). The Trainer lives
    in this frame only: it (and DDP's reducer, which holds the process group) must be gone
    before the group is left, or interpreter exit can deadlock in gloo (docs/design.md's pitfalls)."""
    trainer = Trainer(task, cfg, ctx)
    status = trainer.fit(exiting=True)  # nothing uses the trainer after: its end may free the optimizer
    return status, (trainer.progress.epoch, trainer.progress.global_step)


def hold_run_dir(rank: int, home: RunDir, store: Any) -> None:
    """Under torchrun or srun, rank 0 holds the run dir for the whole job and tells the other
    ranks (through the store) whether it could; ddptrain's own launcher already holds it."""
    global _hold
    if os.environ.get("DDPTRAIN_LOCAL_LAUNCH"):
        return
    key = round_prefix() + "hold"
    if rank == 0:
        try:
            _hold = RunDirHold(home, job_id()).acquire()
        except ConfigError as refused:
            store.set(key, str(refused))
            raise
        store.set(key, "")
        return
    refusal = store.get(key).decode()
    if refusal:
        raise ConfigError(refusal)


def outcome_message(status: str, cfg: RunConfig, reached: tuple[int, int] | None = None) -> str:
    """The launcher's last line for ``status``; ``reached``: ``(epoch, global step)`` where an
    already finished run stands."""
    if status == "preempted":
        return (f"stopped by a signal at a step boundary; snapshot saved in {cfg.run_dir}/snapshots; "
                "run the same command to resume")
    if status == "ended_elsewhere":
        return ""  # rank 0 said it (resilience/replicas.py): nothing was trained here
    if status == "already_finished":
        home = RunDir.of(cfg.run_dir)
        model = home.url_of("model.pt") if home.exists("model.pt") else None
        return finished_message(str(home), cfg, *(reached or (0, 0)), model)
    return f"model saved to {cfg.run_dir}/model.pt"


def finished_message(run_dir: str, cfg: RunConfig, epoch: int, step: int, model: str | None) -> str:
    """What a run that already reached its limits says: which limit it reached, how far it
    went, and flags that train it on (above where it stands, for every limit it reached)."""
    limits = []  # (flag, its value, where the run stands in its unit, the unit)
    if epoch >= cfg.epochs:
        limits.append(("--max-epochs", cfg.epochs, epoch, "epoch(s)"))
    if cfg.max_steps is not None and step >= cfg.max_steps:
        limits.append(("--max-steps", cfg.max_steps, step, "step(s)"))
    if not limits:  # none reached: --early-stop ended it
        kept = f"its model is {model}" if model else "it was stopped before model.pt"
        return (f"{run_dir} holds a run that stopped early at step {step} (--early-stop {cfg.early_stop}); {kept}, "
                f"its best evaluation's in {run_dir.rstrip('/')}/best/. To train it longer, pass a larger "
                "--early-stop (or 0); to train afresh, pass --resume never or another --run-dir")
    what = " and ".join(f"{at} {unit}" for _, _, at, unit in limits)
    reached = " and ".join(f"{flag} {value:g}" for flag, value, _, _ in limits)
    done = f"already finished {what}; its model is {model}" if model else f"was stopped past {what}, before model.pt"
    before_decay = _snapshot_before_decay(run_dir, cfg)
    if all(getattr(cfg, name) == value for name, value in LONGER_RUN_SAME_MATH.items()):
        advice = " and ".join(f"a larger {flag} (above {at})" for flag, _, at, _ in limits)
        longer = f"to train it longer, pass {advice}"
    elif before_decay is not None:  # a warmup-stable-decay: the snapshot before its decay goes on exactly
        longer = (f"its decay (--decay-fraction {cfg.decay_fraction:g}) began after {before_decay}, which goes on "
                  f"exactly: to train it longer, pass --resume {before_decay} and a larger --max-steps")
    else:  # the schedule spans the run: a longer one changes every step's rate (a resume refuses it)
        weights = model or f"{run_dir.rstrip('/')}/model.pt"
        longer = (f"its --lr-schedule {cfg.lr_schedule} (--warmup-steps {cfg.warmup_steps}) spans those steps, so a "
                  f"longer run would change every step's rate and is refused; to train on, start a new run from its "
                  f"weights: --init-from {weights} --run-dir ANOTHER (its optimizer afresh; --init-from "
                  f"{run_dir.rstrip('/')} --init-optimizer carries its optimizer's state too)")
    return (f"{run_dir} holds a run that {done}. It reached {reached} at step {step}; {longer}; to train afresh, "
            "pass --resume never or another --run-dir")


def _snapshot_before_decay(run_dir: str, cfg: RunConfig) -> Path | None:
    """A warmup-stable-decay run's snapshot from the step its decay began (kept whatever --keep
    says: schedules.stable_end), where it is in ``run_dir``; None otherwise."""
    step = stable_end(cfg.optim, cfg.max_steps if cfg.epochs == math.inf else None)
    if step is None:
        return None
    folder = snapshot_dir(Path(run_dir))
    found = [folder / snapshot_name(step, folder=dcp) for dcp in (False, True)]
    return next((path for path in found if path.exists()), None)


def restarts_of_this_job() -> int:
    """How many times this job's ranks were started again: torch elastic's restarts (ddptrain
    train's launcher, torchrun), a Slurm requeue."""
    counts = (os.environ.get(name, "") for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
    return max((int(count) for count in counts if count.isdigit()), default=0)


def own_restart(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """``--resume never`` is the job's first start: it moved an earlier run's files aside, and
    a restart of the same job resumes from the snapshots the job wrote (else every restart began
    again at step 0, and --max-restarts only redid the work): torch elastic's and Slurm's restarts
    count themselves; Ray's are known by the trial's mark (observe/ray_train.py)."""
    if cfg.resume != "never":
        return cfg
    if restarts_of_this_job() or ray_restarted(run_dir):
        return cfg.replace(resume="auto")
    return cfg


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


def pid_file(run_dir: Path, rank: int) -> Path:
    """``RUN_DIR/pids/rank-N.pid``: which process is rank N (to signal it, or find it)."""
    return run_dir / "pids" / f"rank-{rank}.pid"


def write_pid_file(run_dir: Path, rank: int) -> Path:
    path = pid_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")
    return path


def exit_for(outcome: Outcome, is_main: bool) -> int:
    """Print the outcome's message (rank 0) and return the process exit status."""
    status, message = outcome
    if is_main and message:
        prefix = "ddptrain: error: " if status == "config_error" else "ddptrain: "
        say(prefix + message, sys.stderr if status not in ("finished", "already_finished") else sys.stdout)
    return EXIT_CODES[status]
