"""Every exception ddptrain raises, in one place, recognised by type.

``ConfigError`` (and ``SnapshotError``) are the user's mistakes: one line, exit status 2.
The rest say what happened to a job. A rank's exception reaches the launcher as text in
torch's error file ("ExceptionType: message"), so the failure report (resilience/failures.py)
matches these classes' names there.
"""

from __future__ import annotations

import os


class ConfigError(ValueError):
    """Bad input from the user: reported as one line, exit status 2, no training step run."""


class PeerFailed(RuntimeError):
    """This rank was fine: it stopped because another rank failed."""


class RankStuck(RuntimeError):
    """This rank did not reach a collective the others were waiting in (a hang's culprit)."""


class PeerStuck(RuntimeError):
    """This rank waited in a collective for a rank that never arrived."""


class StorageNotShared(RuntimeError):
    """A rank cannot see a file rank 0 wrote: the run dir is not on storage every node shares."""

    def __init__(self, rank: int, path: str | os.PathLike[str]) -> None:
        super().__init__(f"rank {rank} cannot see snapshot {path} written by rank 0: put --run-dir "
                         "on storage every node shares")


class NonFiniteError(RuntimeError):
    """The loss or the weights stopped being finite; nothing non-finite was saved."""


class DiskFull(RuntimeError):
    """A write into the run dir found no space: one line (where, how much was free, what was
    being written, which snapshot is intact), exit status 1."""


class StoreBehind(RuntimeError):
    """A run dir's store did not take the run's last uploads in time: one line (what is not
    uploaded, where it is safe, the command that uploads it), exit status 1."""


class LighthouseLost(RuntimeError):
    """The torchft lighthouse stopped answering and no lighthouse answered on its address
    within --timeout: one line (where, for how long, what to do), exit status 1."""


class SnapshotError(ConfigError):
    """A snapshot cannot be used: one line naming the file and the problem."""


class TrainingFailed(RuntimeError):
    """A rank failed or hung; the message is ddptrain's report (which rank, and why), as the
    command line prints it, and ``exit_code`` the command's status. (A rank's configuration
    error reaches the launcher's caller as the ConfigError it is.)"""

    def __init__(self, report: str, exit_code: int = 1) -> None:
        super().__init__(report)
        self.exit_code = exit_code


class Stopped(RuntimeError):
    """A stop signal ended training after a snapshot; the same call resumes it."""
