"""What the integration tests do with real processes: run commands and ``ddptrain.fit``, kill
what they started, read a run's files, compare weights. (Fixtures live in tests/conftest.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import ddptrain
from ddptrain.observe import report

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
    out, err, late = finish(process, timeout)
    if late:
        raise AssertionError(f"`{' '.join(args)}` ran past {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(args, process.returncode, out, err)


def ddptrain_cli(*args: str, timeout: float = 180, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The real command, in a process of its own (launch, signal and exit paths)."""
    return run([str(BIN / "ddptrain"), *args], timeout=timeout, env=env, cwd=cwd)


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
    """metrics.jsonl's training records: its last line, a finished run's goodput record, is
    test_goodput.py's."""
    return [r for r in report.read_metrics(run_dir) if r.get("kind") != "goodput"]
