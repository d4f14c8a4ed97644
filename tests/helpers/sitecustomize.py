"""Loaded by every Python process the tests start (tests/helpers is on their PYTHONPATH):
with DDPTRAIN_TEST_STACKS set, SIGUSR2 writes the process's threads' stacks to
``$DDPTRAIN_TEST_STACKS/<pid>.stacks``. A command that runs past its time in a test is asked
for them before it is killed (helpers.commands.finish), so a hang seen once in CI says where
each process stood. Diagnostics only: no process sends SIGUSR2 otherwise."""

import faulthandler
import os
import signal


def _listen() -> None:
    folder = os.environ.get("DDPTRAIN_TEST_STACKS")
    if folder and os.path.isdir(folder):
        # faulthandler writes from the signal handler to this descriptor: open now, kept open
        stacks = open(os.path.join(folder, f"{os.getpid()}.stacks"), "w")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)


_listen()
os.register_at_fork(after_in_child=_listen)  # a forked rank writes its own file
