"""``ddptrain lighthouse``: torchft's lighthouse (its ``LighthouseServer``, in this process),
which the replica groups of ``--fault-tolerance torchft`` reach at every step to learn which
groups are alive (resilience/replicas.py). One per run; loopback unless told otherwise. And
the groups' side: where it is (--lighthouse), whether it answers before any rank starts (one
line if not), and a line when it stops and comes back."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from ..errors import ConfigError


def quiet_torchft() -> None:
    """torchft's Rust core logs a few INFO lines per step (quorums, commits) unless RUST_LOG says
    otherwise: warnings only, before it is imported (RUST_LOG set by the user wins)."""
    os.environ.setdefault("RUST_LOG", "warn")


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
        # as the lighthouse binds (SO_REUSEADDR): a lighthouse restarted on its address while the
        # killed one's connections linger (TIME_WAIT) can listen there, and must not be refused
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), int(port)))
        except OSError as error:
            raise ConfigError(f"--bind {bind}: cannot listen there ({error.strerror}); choose another "
                              "address or port") from None
    return host, int(port)


def serve(bind: str, min_replicas: int, heartbeat_timeout_ms: int, join_timeout_ms: int) -> int:
    """Run the lighthouse until SIGINT or SIGTERM; 0."""
    host, port = check(bind, min_replicas, heartbeat_timeout_ms, join_timeout_ms)
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


def read_dashboard(address: str, page: str = "/", timeout_s: float = 5.0) -> str:
    """A page of the lighthouse's dashboard (asked directly, not through an HTTP proxy); OSError
    or ValueError when nothing answers within ``timeout_s``."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with direct.open(address.rstrip("/") + page, timeout=timeout_s) as answer:
        return answer.read(1 << 20).decode(errors="replace")


def lighthouse_address(lighthouse: str) -> str:
    """``--lighthouse``, else TORCHFT_LIGHTHOUSE (``http://HOST:PORT``; ``HOST:PORT`` too)."""
    address = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise ConfigError("--fault-tolerance torchft needs the lighthouse's address: give --lighthouse "
                          "http://HOST:PORT or set TORCHFT_LIGHTHOUSE (ddptrain lighthouse starts one)")
    address = address if "://" in address else f"http://{address}"
    try:
        where = urllib.parse.urlsplit(address)
        port = where.port
    except ValueError:
        port = None
    if where.scheme not in ("http", "https") or not where.hostname or port is None:
        raise ConfigError(f"--lighthouse {lighthouse or address}: not a lighthouse's address; give "
                          "http://HOST:PORT (`ddptrain lighthouse` prints it)")
    return address


LIGHTHOUSE_CHECK_S = 5.0  # the start's wait for the lighthouse's answer


def check_lighthouse(lighthouse: str) -> None:
    """Before any rank starts: a torchft lighthouse answers at the address, one line if not: none
    listens, something listens but never answers, or what answers is no lighthouse (its dashboard,
    the page a lighthouse serves at ``/``, is missing)."""
    address = lighthouse_address(lighthouse)
    start = "start one (ddptrain lighthouse) or give its address"
    try:
        page = read_dashboard(address, timeout_s=LIGHTHOUSE_CHECK_S)
    except urllib.error.HTTPError as error:  # it answered, with an error: no lighthouse's dashboard
        page = f"HTTP {error.code}"
    except (OSError, ValueError) as error:
        if isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError):
            raise ConfigError(f"--lighthouse {address}: something accepts connections there but did not answer "
                              f"within {LIGHTHOUSE_CHECK_S:g} s; {start}") from None
        raise ConfigError(f"--lighthouse {address}: no lighthouse answers there; {start}") from None
    if "torchft" not in page:
        raise ConfigError(f"--lighthouse {address}: what answers there is not a torchft lighthouse; {start}")


class LighthouseWatch:
    """A group's rank 0, while a quorum is pending: does the lighthouse still answer? torchft
    sends a quorum request again while its lighthouse is away, and reconnects to a restarted
    one, but says nothing; this says in a line that the lighthouse stopped answering, and in
    another that it answers again. It asks only once a quorum has been pending ``pending_s``
    (a step's quorum takes milliseconds): a healthy run never pays for it."""

    def __init__(self, address: str, info: Callable[[str], None], timeout_s: float,
                 pending_s: float = 2.0, every_s: float = 1.0) -> None:
        self.address, self.info, self.timeout_s = address, info, timeout_s
        self.pending_s, self.every_s = pending_s, every_s
        self._pending: tuple[int, float] | None = None  # (the step, since when) of the quorum pending
        self.lost_since: float | None = None  # when it was found not answering (None: it answers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ddptrain-lighthouse-watch", daemon=True)
        self._thread.start()

    def pending(self, step: int) -> None:
        """A quorum for the step after ``step`` is asked for (-1: the start's)."""
        self._pending = (step, time.monotonic())

    def settled(self) -> None:
        self._pending = None

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            pending = self._pending
            if self.lost_since is None and (pending is None or time.monotonic() - pending[1] < self.pending_s):
                continue
            answers = self._answers()
            if not answers and self.lost_since is None:
                self.lost_since = time.monotonic()
                step = f"step {pending[0] + 1}: " if pending and pending[0] >= 0 else ""  # (-1: the start)
                self.info(f"ddptrain: {step}the lighthouse at {self.address} stopped answering; the replica groups "
                          f"wait up to --timeout {self.timeout_s:g} s for it (or a new one on its address) to answer")
            elif answers and self.lost_since is not None:
                self.info(f"ddptrain: the lighthouse at {self.address} answers again after "
                          f"{time.monotonic() - self.lost_since:.0f} s; the replica groups train on")
                self.lost_since = None

    def _answers(self) -> bool:
        try:
            read_dashboard(self.address, timeout_s=self.every_s * 2)
        except (OSError, ValueError):
            return False
        return True

    def close(self) -> None:
        self._stop.set()
