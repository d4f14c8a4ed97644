"""A real single-host Slurm cluster for the tests: Debian's slurmctld, slurmd and munge,
configured under a temporary folder and stopped by the PIDs it started.

Installs the packages with apt-get when they are missing (about 15 s here). When the
cluster cannot start, ``start`` raises with the daemons' log tails: a failing test, never a
silent skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from ddptrain import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


def ensure_installed() -> None:
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "srun", "sbatch", "munged")):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
        subprocess.run(install, env=env, capture_output=True, check=True)


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket.2"
        self.daemons: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60) -> None:
        ensure_installed()
        for folder in ("state", "spool", "logs", "munge"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o755)  # munged insists on a socket folder others can read
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge = self.root / "munge"
        self._spawn(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                     f"--pid-file={munge / 'munged.pid'}", f"--log-file={self.root / 'logs' / 'munged.log'}",
                     f"--seed-file={munge / 'seed'}"])
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged did not create its socket")
        self.conf.write_text(self._config())
        env = {**os.environ, **self.env}
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], env)
        self._spawn(["slurmd", "-D", "-f", str(self.conf)], env)
        self._wait(self._node_idle, timeout, "the node did not become idle")

    def _config(self) -> str:
        cpus = os.cpu_count() or 2
        logs = self.root / "logs"
        return "\n".join([
            "ClusterName=ddptrain-test", f"SlurmctldHost={self.host}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            f"StateSaveLocation={self.root / 'state'}", f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}", f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={logs / 'slurmctld.log'}", f"SlurmdLogFile={logs / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2", "KillWait=5",
            "MpiDefault=none", "SchedulerType=sched/backfill", "MinJobAge=600",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            "",
        ])

    def _spawn(self, command: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.root / "logs" / f"{command[0]}.out", "ab")
        self.daemons.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             stdin=subprocess.DEVNULL))

    def _node_idle(self) -> bool:
        done = subprocess.run(["sinfo", "-h", "-o", "%t"], env={**os.environ, **self.env},
                              capture_output=True, text=True)
        return done.returncode == 0 and done.stdout.strip() == "idle"

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            if any(d.poll() is not None for d in self.daemons):
                break
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"Slurm test cluster: {what}\n{self.log_tails()}")

    def log_tails(self, lines: int = 15) -> str:
        tails = []
        for path in sorted((self.root / "logs").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(tails)

    def stop(self) -> None:
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
        self.daemons.clear()
