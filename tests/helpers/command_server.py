"""Forks ``ddptrain`` commands for the tests from one interpreter that has already imported
what every command imports (torch, torch._dynamo, torch.distributed.checkpoint): 2.3 of the
2.7 CPU-seconds a 1-epoch 2-rank ``ddptrain train`` costs are those imports, paid again by
every command the tests start. A forked command is a process of its own with its own session,
standard streams, environment, folder and exit status, running ``ddptrain.start.entry`` as the
installed script does; what it skips is the interpreter's start (and the allocator's re-exec:
it runs under mimalloc from the start, as the re-executed command does). Tests of the start
itself run the installed command (helpers.commands.ddptrain_cli(fresh=True)).

Protocol (a Unix SEQPACKET socket, a connection per command): the client sends the command as
JSON ({"argv", "env", "cwd"}) with its stdin, stdout and stderr descriptors attached; the server
answers the child's pid, then "<exit status> <CPU-seconds>": the status as ``subprocess``
reports it (negative: killed by that signal), and the CPU the command and its ranks used. The
server is single-threaded (a fork copies no other thread) and ends when its own stdin closes:
the test process that started it is gone.

Run as ``python command_server.py SOCKET_PATH``.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import traceback

# What `ddptrain train` has imported when it forks its ranks (launch/local.py).
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401

import ddptrain.cli  # noqa: F401
import ddptrain.launch.local  # noqa: F401
import ddptrain.start
import ddptrain.trainer  # noqa: F401
from ddptrain.launch import allocator

STREAMS = 3  # stdin, stdout, stderr


def run_command(request: dict, fds: list[int]) -> None:
    """In the forked child: become the command, run it, never return."""
    code = 1
    try:
        os.setsid()  # its own session and process group, as the tests' Popen(start_new_session=True)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd >= STREAMS:
                os.close(fd)
        os.chdir(request["cwd"])
        argv = request["argv"]
        env = request["env"]
        library = allocator.mimalloc_path()
        if library is not None and allocator.wants_mimalloc(argv[1:], env):
            env = allocator.preloaded_env(env, library)  # what the re-exec would have set
        os.environ.clear()
        os.environ.update(env)
        sys.argv = argv
        # a task module on the test's own PYTHONPATH, beyond the server's
        sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        ddptrain.start.entry()  # ends the process (failures.hard_exit) unless something raises
        code = 0
    except SystemExit as stop:  # argparse's errors, as the interpreter would end on them
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's end writes to wake_w
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "request")
    selector.register(wake_r, selectors.EVENT_READ, "child ended")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent gone")
    waiting: dict[int, socket.socket] = {}  # a running command's pid: its client's connection
    while True:
        for key, _ in selector.select():
            if key.data == "parent gone":
                return
            if key.data == "request":
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, 1 << 20, STREAMS)
                pid = os.fork()
                if pid == 0:  # the command holds nothing of the server's but the preloaded modules
                    signal.set_wakeup_fd(-1)
                    for held in (selector, listener, *waiting.values()):
                        held.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    run_command(json.loads(message), fds)
                for fd in fds:
                    os.close(fd)
                connection.send(str(pid).encode())
                waiting[pid] = connection
            else:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
                reap(waiting)


def reap(waiting: dict[int, socket.socket]) -> None:
    """Send each ended command's exit status to its client."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = waiting.pop(pid, None)
        if connection is not None:
            try:
                cpu = usage.ru_utime + usage.ru_stime  # its children's too, those it waited for
                connection.send(f"{os.waitstatus_to_exitcode(status)} {cpu:.3f}".encode())
            except OSError:  # the client stopped waiting
                pass
            connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])
