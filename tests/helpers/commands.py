"""What the integration tests do with real processes: run commands and ``ddptrain.fit``, kill
what they started, read a run's files, compare weights. (Fixtures live in tests/conftest.py.)"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import torch

import ddptrain
from ddptrain.launch import allocator
from ddptrain.observe import summary as records

TESTS = Path(__file__).parent.parent
REPO = TESTS.parent
BIN = Path(sys.executable).parent


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, plus ``extra``."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("SLURM_")}
    env.update(extra)
    return env


def descendants(pid: int) -> list[int]:
    """Every living process started by ``pid``, its children's children included."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def listening_addresses(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on, read from /proc."""
    import ipaddress

    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone, or a descriptor closed between the listing and the read
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # little-endian 32-bit words
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((str(ipaddress.ip_address(raw) if width == 16 else ipaddress.IPv4Address(raw)),
                           int(port, 16)))
    return found


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and everything it started. Found by parentage before anything dies
    (an orphan is adopted by init): torchrun's workers are not in torchrun's process group."""
    family = descendants(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)  # its session (start_new_session): orphans of earlier kills too
    except ProcessLookupError:
        pass
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(process: subprocess.Popen, timeout: float) -> tuple[str, str, bool]:
    """(stdout, stderr, ran past the timeout) of a started command; past ``timeout`` every
    process it started is killed, and reading what it wrote waits 10 s at most."""
    try:
        out, err = process.communicate(timeout=timeout)
        return out, err, False
    except subprocess.TimeoutExpired:
        stacks = ask_for_stacks([process.pid, *descendants(process.pid)])
        kill_tree(process)
    try:
        out, err = process.communicate(timeout=10)
    except subprocess.TimeoutExpired:  # a process outside the tree still holds the pipes
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
        out, err = "", "(output lost: the pipes stayed open after every process was killed)"
    return out, err + stacks, True


def ask_for_stacks(pids: list[int], wait_s: float = 1.0) -> str:
    """Every thread's stack in each of ``pids`` that runs Python (helpers/sitecustomize.py:
    SIGUSR2), with its command line: where a command that ran past its time stood."""
    folder = os.environ.get("DDPTRAIN_TEST_STACKS")
    if not folder:
        return ""
    commands = {}
    for pid in pids:
        try:
            commands[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
            os.kill(pid, signal.SIGUSR2)
        except OSError:  # gone meanwhile
            continue
    time.sleep(wait_s)
    found = []
    for pid, command in commands.items():
        dump = Path(folder, f"{pid}.stacks")
        text = (dump.read_text(errors="replace") if dump.exists() else "").strip()
        found.append(f"--- process {pid}: {command.strip()}\n{text or '(no stacks: not Python, or no answer)'}")
    return "\n\nthe stacks of every process when it ran past its time:\n" + "\n".join(found) if found else ""


def run(args: list[str], timeout: float = 180, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command to completion. Past ``timeout`` the test fails, and everything the
    command started (launchers leave ranks behind otherwise) is killed."""
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env or clean_env(), cwd=cwd, stdin=subprocess.DEVNULL, start_new_session=True)
    return complete(process, timeout)


def complete(process: subprocess.Popen | ForkedCommand, timeout: float) -> subprocess.CompletedProcess[str]:
    """A started command's result; past ``timeout`` the test fails (``finish``)."""
    out, err, late = finish(process, timeout)
    if late:
        raise AssertionError(f"`{' '.join(process.args)}` ran past {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def ddptrain_cli(*args: str, timeout: float = 180, env: dict[str, str] | None = None,
                 cwd: Path | None = None, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """``ddptrain <args>`` in a process of its own, run to completion. Forked by the command
    server (helpers/command_server.py) from an interpreter that has imported torch: the same
    ``ddptrain.start.entry`` in its own session, with its own streams, environment, folder and exit
    status, without the 2.3 CPU-seconds of imports every start costs. ``fresh``: the installed
    command, executed as a user runs it, for tests of the start itself (launchers, the
    allocator's re-exec, errors before torch is imported)."""
    argv = [str(BIN / "ddptrain"), *args]
    if fresh:
        return run(argv, timeout=timeout, env=env, cwd=cwd)
    return complete(start_cli(*args, env=env, cwd=cwd), timeout)


def start_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
              output: IO | None = None) -> ForkedCommand:
    """``ddptrain <args>`` started by the command server, not waited for (``ddptrain_cli``);
    ``output``: a file for its stdout and stderr, else pipes its ``communicate`` reads."""
    return ForkedCommand([str(BIN / "ddptrain"), *args], env or clean_env(), cwd, output)


class ForkedCommand:
    """A command the command server forked, with what these helpers use of ``subprocess.Popen``:
    ``args``, ``pid``, ``communicate`` (with a timeout, and again after one), ``poll``, ``wait``
    and ``returncode``. Its parent is the server, not this process: its end comes from the
    server's connection, its output from pipes this process made."""

    _server: subprocess.Popen | None = None
    _socket_path = ""
    stdout = stderr = None  # no stream objects: finish() has nothing of them to close
    cpu_seconds = 0.0  # what the ended commands cost, as RUSAGE_CHILDREN counts a child's (conftest)

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path | None = None, output: IO | None = None) -> None:
        """``output``: a file for both streams (then ``communicate`` returns them empty), else pipes."""
        self.args = argv
        self.returncode: int | None = None
        stdin = os.open(os.devnull, os.O_RDONLY)
        if output is None:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            self._open, streams = [out_r, err_r], [stdin, out_w, err_w]
        else:
            self._open, streams = [], [stdin, os.dup(output.fileno()), os.dup(output.fileno())]
        self._read: dict[int, bytearray] = {fd: bytearray() for fd in self._open}
        self._status = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._status.connect(self.server())
        request = {"argv": argv, "env": env, "cwd": str(cwd or os.getcwd())}
        socket.send_fds(self._status, [json.dumps(request).encode()], streams)
        for fd in streams:
            os.close(fd)
        self.pid = int(self._status.recv(64))

    @classmethod
    def server(cls) -> str:
        """The socket of this process's command server, started at the first command (it
        ends when this process does: its stdin, a pipe from here, closes)."""
        if cls._server is None or cls._server.poll() is not None:
            folder = tempfile.mkdtemp(prefix="ddptrain-commands-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            cls._socket_path = os.path.join(folder, "socket")
            env = clean_env()
            library = allocator.mimalloc_path()
            if library is not None:  # as `ddptrain train` re-executes itself (its ranks are forked from it)
                env = allocator.preloaded_env(env, library)
            cls._server = subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "command_server.py"), cls._socket_path],
                stdin=subprocess.PIPE, env=env, start_new_session=True)
            deadline = time.monotonic() + 120
            while not os.path.exists(cls._socket_path):
                if cls._server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the command server did not start (exit {cls._server.poll()})")
                time.sleep(0.05)
        return cls._socket_path

    def poll(self) -> int | None:
        if self.returncode is None:
            self._status.setblocking(False)
            try:
                self._ended(self._status.recv(64))
            except BlockingIOError:
                self._status.setblocking(True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._status.settimeout(timeout)
            try:
                self._ended(self._status.recv(64))
            except TimeoutError:
                self._status.settimeout(None)
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def _ended(self, message: bytes) -> None:
        if message:
            code, cpu = message.split()
            self.returncode = int(code)
            ForkedCommand.cpu_seconds += float(cpu)
        else:  # the server ended without saying (killed)
            self.returncode = -signal.SIGKILL
        self._status.close()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both streams to their end, then the exit status, as ``Popen.communicate`` with text."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for fd in self._open:
                selector.register(fd, selectors.EVENT_READ)
            while self._open:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        self._read[key.fd] += chunk
                    else:
                        selector.unregister(key.fd)
                        os.close(key.fd)
                        self._open.remove(key.fd)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.001))
        out, err = self._read.values() if self._read else (b"", b"")
        return out.decode(errors="replace"), err.decode(errors="replace")


def fit(task, run_dir: Path, env: dict[str, str] | None = None, **options):
    """``ddptrain.fit`` in this process: ranks are forked from the test process (no new
    interpreter, torch already imported), the same path as ``ddptrain train``. ``env``:
    variables the ranks see (the test helpers read them), removed afterwards."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return ddptrain.fit(task, run_dir=str(run_dir), **{"nproc": 2, **options})
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def load_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "model.pt", weights_only=True)


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool = False) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), f"{key} differs"
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=f"{key} differs")


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie has exited: it is not left running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's epoch and evaluation records: its last line, a finished run's goodput
    record, is test_goodput.py's, and the step records of --log-every are test_watching.py's
    (``ddptrain.observe.summary.read_metrics`` reads every line)."""
    return [r for r in records.read_metrics(run_dir) if r.get("kind") not in ("goodput", "step")]
