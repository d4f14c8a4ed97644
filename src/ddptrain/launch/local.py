"""Starting local ranks through torch's elastic launcher (the engine under torchrun).

No home-made process manager: restarts (``--max-restarts``), stopping the other ranks when
one fails, and per-rank error reports come from ``torch.distributed.launcher``. This module
adds what a user of ``ddptrain train`` or ``ddptrain.fit()`` sees: one clear report (which
rank failed and why, or which rank hung), and a process left as it was found (signal
handlers and environment restored: ``fit()`` may run inside someone's script or notebook).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ..console import native_stderr_to
from ..errors import ConfigError
from ..observe.goodput import LAUNCHED_AT
from ..resilience.failures import job_failure
from ..resilience.stop_signals import restore_handlers
from ..run_dir import RunDir
from ..settings import RunConfig
from ..tasks.protocol import TaskFactory
from .environments import Environment, LocalEnvironment
from .group import cuda_count, is_loopback, store_server
from .rank import Outcome, rank_entry

# The elastic agent installs handlers for these in the launching process and leaves them.
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# torch logs every failed rank's traceback as an unreadable wall, and a line per rank it
# terminates after another ended; failure_report / the hang report say which rank caused it.
QUIETED_LOGGERS = {
    "torch.distributed.elastic.multiprocessing.api": logging.CRITICAL,
    "torch.distributed.elastic.agent.server.api": logging.ERROR,
    "torch.multiprocessing.spawn": logging.ERROR,
}


def auto_nproc(device: str) -> int:
    """One rank per GPU; without GPUs (or with --device cpu), 2 CPU ranks."""
    gpus = cuda_count() if device != "cpu" else 0
    return gpus if gpus > 0 else 2


def start_method(device_kind: str) -> str:
    # fork reuses this process's imported torch (~2.5 s saved per rank); CUDA cannot survive
    # a fork, so GPU runs spawn (this process never initialises CUDA either way).
    return "spawn" if device_kind == "cuda" else "fork"


def check_can_listen(addr: str, port: int) -> None:
    """The rendezvous store listens on MASTER_ADDR:MASTER_PORT; say so at once if it cannot
    (the tutorial's fixed port 12355 fails like this when a second job starts)."""
    try:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((addr, port))
    except OSError as error:
        hint = ("another job uses it: unset MASTER_PORT to let the OS pick a free port, or choose another"
                if error.errno == errno.EADDRINUSE else "is MASTER_ADDR an address of this machine?")
        where = f"MASTER_ADDR:MASTER_PORT {addr}:{port}"
        raise ConfigError(f"cannot listen on {where} ({error.strerror}); {hint}") from None


@contextlib.contextmanager
def launcher_scope(native_log: Path | None, **variables: str) -> Iterator[None]:
    """Set ``variables``, quiet torch's launcher logs and send native code's writes to stderr
    (torch's C++ warnings) to ``native_log`` for the launch; afterwards restore the environment
    (the elastic agent adds variables of its own), the signal handlers, the log levels and
    stderr. ``native_log`` None: stderr stays (spawned ranks inherit descriptor 2 as it is, and
    could not take the console back as forked ones do: rank_entry)."""
    handlers = {sig: signal.getsignal(sig) for sig in AGENT_SIGNALS}
    loggers = {name: logging.getLogger(name) for name in QUIETED_LOGGERS}
    levels = {name: logger.level for name, logger in loggers.items()}
    saved = dict(os.environ)
    os.environ.update(variables)
    for name, logger in loggers.items():
        logger.setLevel(QUIETED_LOGGERS[name])
    try:
        with native_stderr_to(native_log, restore_after_error=True) if native_log else contextlib.nullcontext():
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        restore_handlers(handlers)
        for name, logger in loggers.items():
            logger.setLevel(levels[name])


def new_job_id() -> str:
    """The name of a job ddptrain launches here (hold.job_id): host, process, and a nonce."""
    return f"local-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def launch_local(cfg: RunConfig, nproc: int, device_kind: str, factory: TaskFactory | None,
                 env: Environment | None = None) -> Outcome:
    """Run ``nproc`` ranks on this machine; rank 0's outcome, or TrainingFailed / ConfigError.
    ``env``: one that starts the ranks (no launcher; a PyTorchJob pod is one node of several,
    meeting at the master pod's address)."""
    env = env or LocalEnvironment()
    run_dir = RunDir.of(cfg.run_dir).local  # a store's run dir: this machine's mirror (logs stay here)
    addr, port = env.master_addr, env.master_port  # port 0: the OS picks a free one, no clashes
    meeting = env.rendezvous(cfg.timeout)
    agent_store = None
    if meeting.own_endpoint:
        check_can_listen(addr, port)
        if env.nodes == 1 and is_loopback(addr):  # every rank is here: the agent's store on loopback alone
            agent_store = store_server(addr, port, cfg.timeout)  # (the rendezvous's store is this one)
            port = agent_store.port
    config = LaunchConfig(
        min_nodes=env.nodes, max_nodes=env.nodes, nproc_per_node=nproc, run_id=meeting.run_id,
        # c10d, not the faster "static" rendezvous (0.13 s against 0.3-0.4 s here): under static,
        # a restarted rank 0 hung creating its store on the agent's port (tried: the kill tests).
        rdzv_backend="c10d", rdzv_endpoint=f"{addr}:{port}", local_addr=meeting.local_addr,
        rdzv_configs=meeting.configs,
        max_restarts=cfg.max_restarts, monitor_interval=0.1, start_method=start_method(device_kind),
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs")),
    )
    # A restarted rank must not reuse the previous attempt's store (gloo connectFullMesh
    # failures or hangs, pytorch/pytorch#135712); the restart tests here pass with it.
    native_log = run_dir / "logs" / "launcher.stderr" if config.start_method == "fork" else None
    scope = launcher_scope(native_log,  # torch's C++ warnings (a failed reverse lookup of a rank's address)
                           TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", DDPTRAIN_LOCAL_LAUNCH="1",
                           DDPTRAIN_LAUNCHER_PID=str(os.getpid()),
                           # the attempt's start (goodput.py): `ddptrain train`'s process's, else now
                           **{LAUNCHED_AT: os.environ.get(LAUNCHED_AT) or str(time.time())})
    try:
        with scope:
            if config.start_method == "fork":
                # DDP's constructor imports torch._dynamo (~1.5 s); done once here, forked ranks share
                # it. Inside the scope: the import sets TORCHINDUCTOR_CACHE_DIR, which goes with it.
                import torch._dynamo  # noqa: F401
            outcomes = elastic_launch(config, rank_entry)(cfg, factory)
    except ChildFailedError as failure:
        raise job_failure(failure, nproc, run_dir) from None
    except RendezvousTimeoutError:
        line = env.join_failed(cfg.timeout)
        if line is None:
            raise
        raise ConfigError(line) from None
    except SignalException as stop:
        return "preempted", (f"stopped by {stop.sigval.name}; the ranks saved a snapshot if they reached a "
                             "step boundary; run the same command to resume")
    return outcomes[min(outcomes)]  # keyed by global rank: this node's first (rank 0's on the first node)
