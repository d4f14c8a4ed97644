"""``ddptrain`` for the docs' runnable blocks: each command forked by the test process's command
server (command_server.py), which has imported torch once, instead of a new interpreter that
imports it again (2.3 of the 2.7 CPU-seconds of a one-epoch command; a block's commands are most
of its CPU). The block's shell still sees one process per command: this client, which passes on
the block's streams, folder and environment, passes a signal sent to it on to the command (a
block's ``kill $!`` and ``trap``), and ends as the command ended (killed by a signal: by the same
signal, so the shell reports 128 + N). What a user's start adds (the interpreter, the allocator's
re-execution) the tests of the start cover (test_launch_modes.py, test_allocator.py).

Installed by test_docs.py as ``ddptrain`` in a folder ahead of the venv's on the block's PATH;
``DDPTRAIN_COMMAND_SERVER`` is the server's socket, ``DDPTRAIN_COMMAND`` the installed command,
``DDPTRAIN_SERVED_PIDS`` a folder where each command's pid is written (the command is the
server's child, not this one's: the block's end kills what it left, as a killed tree would).
"""

import json
import os
import signal
import socket
import sys

PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(os.environ["DDPTRAIN_COMMAND_SERVER"])
    request = {"argv": [os.environ["DDPTRAIN_COMMAND"], *sys.argv[1:]], "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
    pid = int(connection.recv(64))
    with open(os.path.join(os.environ["DDPTRAIN_SERVED_PIDS"], str(pid)), "w"):
        pass
    for number in PASSED_ON:
        signal.signal(number, lambda received, _: os.kill(pid, received))
    ended = connection.recv(64)
    code = int(ended.split()[0]) if ended else -signal.SIGKILL  # (no answer: the server was killed)
    if code < 0:  # killed by a signal: end by it too
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
