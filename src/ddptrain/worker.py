"""One rank's life: find its place, build the task, join the process group, train, leave.

``run_rank`` is the entry point both for ranks that ddptrain starts itself (through torch's
elastic launcher) and for a process started by torchrun or srun. ``@record`` writes a
failing rank's traceback where the launcher finds and prints it.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from . import tasks
from .config import ConfigError, RunConfig, default_run_dir
from .dist import check_comm_hook, process_group, resolve_device_kind
from .environments import Environment, detect
from .preemption import PREEMPTED_EXIT_CODE
from .trainer import Trainer

# What a rank returns: ("finished"|"preempted"|"config_error", message).
Outcome = tuple[str, str]
EXIT_CODES = {"finished": 0, "config_error": 2, "preempted": PREEMPTED_EXIT_CODE}


@record
def run_rank(cfg: RunConfig, local_rank_arg: int | None = None) -> Outcome:
    env = detect(local_rank_arg=local_rank_arg)
    show_warnings_with_rank(env.rank)
    try:
        check_comm_hook(cfg.comm_hook, resolve_device_kind(cfg.device, cfg.backend, env.local_world_size)[1])
        task = tasks.build(cfg)
        cfg = cfg.with_task_defaults(task.defaults)
        check_batch_fits(len(task.train_set), env.world_size, cfg.batch_size)
        with process_group(env, cfg.device, cfg.backend, cfg.timeout) as ctx:
            cfg.run_dir = agree_on_run_dir(cfg.run_dir, env)
            pid_file = write_pid_file(Path(cfg.run_dir), ctx.rank)
            outcome = Trainer(task, cfg, ctx).fit()
            pid_file.unlink(missing_ok=True)
    except ConfigError as error:
        if getattr(error, "every_rank", False) and env.rank != 0:
            print(f"ddptrain: error: {error}", file=sys.stderr, flush=True)
        return "config_error", str(error)
    if outcome == "preempted":
        return outcome, (f"stopped by a signal at a step boundary; snapshot saved in "
                         f"{cfg.run_dir}/snapshots; run the same command to resume")
    return outcome, f"model saved to {cfg.run_dir}/model.pt"


def show_warnings_with_rank(rank: int) -> None:
    """Warnings print as one line that says which rank raised them."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"ddptrain: rank {rank}: {category.__name__}: {message}", file=file or sys.stderr, flush=True)
    warnings.showwarning = show


def check_batch_fits(dataset_len: int, world_size: int, batch_size: int) -> None:
    share = -(-dataset_len // world_size)
    if batch_size > share:
        raise ConfigError(f"--batch-size {batch_size} is larger than a rank's share of the data "
                          f"({dataset_len} samples / {world_size} ranks = {share}); use "
                          f"--batch-size {share} or less")


def agree_on_run_dir(run_dir: str | None, env: Environment) -> str:
    """Every rank must write to the same folder: rank 0's choice wins."""
    if run_dir is None:
        job_id = env.env.get("SLURM_JOB_ID") or env.env.get("TORCHELASTIC_RUN_ID", "none")
        # A job id survives torchrun restarts and Slurm requeues, so resume finds its snapshots.
        run_dir = os.path.join("runs", f"job-{job_id}") if job_id != "none" else default_run_dir()
    choice = [run_dir]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


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
        print(prefix + message, file=sys.stderr if status != "finished" else sys.stdout, flush=True)
    return EXIT_CODES[status]
