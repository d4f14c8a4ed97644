"""Starting local ranks through torch's elastic launcher (the engine under torchrun).

No home-made process manager: restarts (``--max-restarts``), fail-fast (one failed rank
stops the others) and per-rank error reports come from ``torch.distributed.launcher``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .config import ConfigError, RunConfig
from .dist import cuda_count
from .preemption import PREEMPTED_EXIT_CODE
from .worker import exit_for, run_rank


def auto_nproc(device: str) -> int:
    """One rank per GPU; without GPUs (or with --device cpu), 2 CPU ranks."""
    gpus = cuda_count() if device != "cpu" else 0
    return gpus if gpus > 0 else 2


def start_method(device_kind: str) -> str:
    # fork reuses this process's imported torch (~2.5 s saved per rank); CUDA cannot survive
    # a fork, so GPU runs spawn (this process never initialises CUDA either way).
    return "spawn" if device_kind == "cuda" else "fork"


def check_can_listen(addr: str, port: str) -> None:
    """The rendezvous store listens on MASTER_ADDR:MASTER_PORT; say so at once if it cannot
    (the tutorial's fixed port 12355 fails like this when a second job starts)."""
    try:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((addr, int(port)))
    except ValueError:
        raise ConfigError(f"MASTER_PORT={port!r} is not a port number; unset it to let the OS pick one") from None
    except OSError as error:
        hint = ("another job uses it: unset MASTER_PORT to let the OS pick a free port, or choose another"
                if error.errno == errno.EADDRINUSE else "is MASTER_ADDR an address of this machine?")
        where = f"MASTER_ADDR:MASTER_PORT {addr}:{port}"
        raise ConfigError(f"cannot listen on {where} ({error.strerror}); {hint}") from None


def launch_local(cfg: RunConfig, nproc: int, device_kind: str) -> int:
    """Run ``nproc`` ranks on this machine and return the exit status for the command."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT", "0")  # 0: the OS picks a free port, no clashes
    check_can_listen(addr, port)
    # A restarted rank must not reuse the previous attempt's store (gloo connectFullMesh
    # failures or hangs, pytorch/pytorch#135712); the restart tests here pass with it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint=f"{addr}:{port}", local_addr=addr,
        max_restarts=cfg.max_restarts, monitor_interval=0.1, start_method=start_method(device_kind),
        logs_specs=DefaultLogsSpecs(log_dir=str(Path(cfg.run_dir or ".") / "logs")),
    )
    # torch logs every failed rank's traceback as an unreadable wall; failure_report says
    # which rank failed first and shows that one.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    if config.start_method == "fork":
        # DDP's constructor imports torch._dynamo (~2 s); done once here, forked ranks share it.
        import torch._dynamo  # noqa: F401
    try:
        outcomes = elastic_launch(config, run_rank)(cfg)
    except ChildFailedError as failure:
        print(failure_report(failure, nproc), file=sys.stderr, flush=True)
        return 1
    except SignalException as stop:
        print(f"ddptrain: stopped by {stop.sigval.name}; the ranks saved a snapshot if they "
              f"reached a step boundary; run the same command to resume", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return exit_for(outcomes[0], is_main=True)


def failure_report(failure: ChildFailedError, nproc: int) -> str:
    """The rank that failed first, with its traceback, then one line per other rank.

    With a function entry point the elastic agent reports whichever failed rank it polled
    first, often a rank that only lost its peer ("Connection closed by peer"). Each failed
    rank's ``@record`` error file is timestamped by the file system, so the earliest one is
    the root cause.
    """
    reported = next(iter(failure.failures.values()))
    errors = _error_files(Path(reported.error_file).parent.parent) if reported.error_file else {}
    if not errors:
        return (f"ddptrain: rank {reported.local_rank} failed (exit code {reported.exitcode}, "
                f"{reported.signal_name() if reported.exitcode < 0 else 'no error report'}); "
                "the other ranks were stopped\n" + str(failure))
    first = min(errors, key=lambda rank: errors[rank][0])
    lines = [f"ddptrain: rank {first} failed first; its traceback:", errors[first][2].rstrip(), ""]
    for rank in range(nproc):
        if rank != first:
            summary = errors[rank][1] if rank in errors else "no error report (stopped by the launcher, or killed)"
            lines.append(f"ddptrain: rank {rank}: {summary}")
    lines.append(f"ddptrain: training failed; error reports in {Path(reported.error_file).parent.parent}")
    return "\n".join(lines)


def _error_files(attempt_dir: Path) -> dict[int, tuple[int, str, str]]:
    """rank -> (mtime ns, one-line message, traceback) from an attempt's error.json files."""
    found = {}
    for path in attempt_dir.glob("*/error.json"):
        try:
            body = json.loads(path.read_text())["message"]
            found[int(path.parent.name)] = (path.stat().st_mtime_ns, body["message"],
                                            body["extraInfo"]["py_callstack"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found
