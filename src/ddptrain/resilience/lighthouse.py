"""``ddptrain lighthouse``: torchft's lighthouse (its ``LighthouseServer``, in this process),
which the replica groups of ``--fault-tolerance torchft`` reach at every step to learn which
groups are alive (resilience/replicas.py). One per run; loopback unless told otherwise."""

from __future__ import annotations

import signal
import socket
import threading

from ..errors import ConfigError


def check(bind: str, min_replicas: int, heartbeat_timeout_ms: int, join_timeout_ms: int) -> tuple[str, int]:
    """The bind address as (host, port); ConfigError (one line) for a bad value."""
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--bind {bind}: give HOST:PORT, e.g. 127.0.0.1:29510")
    for name, value in (("--min-replicas", min_replicas), ("--heartbeat-timeout-ms", heartbeat_timeout_ms),
                        ("--join-timeout-ms", join_timeout_ms)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise ConfigError("ddptrain lighthouse needs the torchft package; pip install 'ddptrain[ft]'")
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as probe:
        try:
            probe.bind((host.strip("[]"), int(port)))
        except OSError as error:
            raise ConfigError(f"--bind {bind}: cannot listen there ({error.strerror}); choose another "
                              "address or port") from None
    return host, int(port)


def serve(bind: str, min_replicas: int, heartbeat_timeout_ms: int, join_timeout_ms: int) -> int:
    """Run the lighthouse until SIGINT or SIGTERM; 0."""
    host, port = check(bind, min_replicas, heartbeat_timeout_ms, join_timeout_ms)
    from .replicas import quiet_torchft

    quiet_torchft()
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=bind, min_replicas=min_replicas, heartbeat_timeout_ms=heartbeat_timeout_ms,
                              join_timeout_ms=join_timeout_ms)
    print(f"ddptrain: lighthouse on http://{host}:{port}: give every replica group --lighthouse "
          f"http://{host}:{port} (or TORCHFT_LIGHTHOUSE)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0
