"""What one failure costs, for the same job: a plain restart from the newest snapshot against
--fault-tolerance torchft (docs/fault-tolerance.md), on this machine's CPU (gloo, loopback).

    python benchmarks/fault_tolerance.py [--reps 3] [--kill-step 60] [--save-every 20] [--startup-s 5]

The job: the tutorial's regression, each step made STEP_SLEEP (0.02) s longer so that it is
not all start-up, 6 epochs of 32 steps of 2 x 32 samples (ranks or groups), and each rank's
start --startup-s (5) s longer, standing for what a real job's start costs (loading a model
and data, NCCL's initialisation), which a restart pays again. One rank or group SIGKILLs
itself at --kill-step, once.

- restart: `ddptrain train --nproc 2 --max-restarts 1 --save-every N`: every rank restarts and
  resumes from the newest snapshot, and repeats the steps since it.
- elastic: `torchrun --nnodes 1:2 --nproc-per-node 1` twice on loopback (two "nodes" of one
  rank, c10d rendezvous, `--max-restarts 1`, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 as
  docs/multinode.md says); the killed node's agent dies with its rank (the node is gone and
  stays gone): the other node's rank restarts alone at the next rendezvous, resumes from the
  newest snapshot with the same global batch, and repeats the steps since it.
- torchft: 2 replica groups of 1 rank (`ddptrain lighthouse`, heartbeat timeout 2 s), the
  killed group restarted by its own `--max-restarts 1`; the other trains on.

Per failure: the seconds the job lost (its wall time against the same job uninterrupted, the
healthy group's for torchft), the steps redone (restart) or missed by the failed group
(torchft), and the longest wait between two of rank 0's (group 0's) steps. Medians over the
repetitions, ranges beside them.
"""

import argparse
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddptrain import Task, free_port
from ddptrain.tasks import regression_task

BENCH = Path(__file__).resolve().parent
DDPTRAIN = [sys.executable, "-m", "ddptrain"]
STEPS = 192  # 6 epochs of 32
JOB = ["--task", "fault_tolerance:paced", "--max-epochs", "6", "--batch-size", "32", "--save-seconds", "0"]


def paced(cfg) -> Task:
    """The job's task (run by the ranks): regression, each loss STEP_SLEEP s later, rank 0's
    times in STEP_LOG; rank KILL_RANK SIGKILLs itself at its KILL_STEP-th loss once (KILL_MARKER),
    with KILL_NODE its whole process group (a torchrun agent started in a session of its own)."""
    time.sleep(float(os.environ.get("STARTUP_S", "0")))
    task = regression_task(cfg)
    rank, pause = int(os.environ["RANK"]), float(os.environ.get("STEP_SLEEP", "0.02"))
    log, marker = os.environ.get("STEP_LOG"), Path(os.environ.get("KILL_MARKER", "/nonexistent"))
    killed = os.environ.get("KILL_RANK") in (str(rank), "any")  # any: whichever rank this process is
    kill_at = int(os.environ.get("KILL_STEP", "0")) if killed else 0
    victim = os.getpgid(0) if os.environ.get("KILL_NODE") else 0  # the node: its agent's process group
    calls = {"n": 0}
    loss_fn = task.loss_fn

    def counted(*args):
        calls["n"] += 1
        time.sleep(pause)
        if calls["n"] == kill_at and not marker.exists():
            marker.write_text("killed")
            if victim:
                os.killpg(victim, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if log and rank == 0:
            with open(log, "a") as out:
                out.write(f"{time.time():.3f}\n")
        return loss_fn(*args)
    task.loss_fn = counted
    return task


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(BENCH), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               DDPTRAIN_FT_HOST="127.0.0.1", **extra)
    return env


def _longest_gap(step_log: Path) -> float:
    times = [float(t) for t in step_log.read_text().split()]
    return max(b - a for a, b in zip(times, times[1:]))


def restart(folder: Path, kill: bool, kill_step: int, save_every: int) -> dict[str, float]:
    log = folder / "steps"
    env = _env(STEP_LOG=str(log), **({"KILL_RANK": "1", "KILL_STEP": str(kill_step),
                                       "KILL_MARKER": str(folder / "killed")} if kill else {}))
    started = time.perf_counter()
    subprocess.run([*DDPTRAIN, "train", *JOB, "--nproc", "2", "--max-restarts", "1", "--save-every", str(save_every),
                    "--run-dir", str(folder / "run")], env=env, check=True, capture_output=True)
    wall = time.perf_counter() - started
    redone = kill_step - (kill_step - 1) // save_every * save_every - 1 if kill else 0
    return {"wall": wall, "steps": redone, "gap": _longest_gap(log)}


def elastic(folder: Path, kill: bool, kill_step: int, save_every: int) -> dict[str, float]:
    log, port = folder / "steps", free_port()
    env = _env(STEP_LOG=str(log), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    doomed = {"KILL_RANK": "any", "KILL_STEP": str(kill_step), "KILL_NODE": "1",
              "KILL_MARKER": str(folder / "killed")} if kill else {}

    def node(host: bool) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1",
             "--monitor-interval=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench",
             f"--rdzv-conf=is_host={int(host)},last_call_timeout=2", "-m", "ddptrain", "train", *JOB,
             "--save-every", str(save_every), "--run-dir", str(folder / "run")],
            env={**env, **({} if host else doomed)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a process group per node: KILL_NODE takes the agent with its rank

    started = time.perf_counter()
    nodes = [node(host=True), node(host=False)]
    try:
        if nodes[0].wait(timeout=600) != 0:
            raise SystemExit(f"elastic: the first node's torchrun exited {nodes[0].returncode}")
        wall = time.perf_counter() - started
    finally:
        for agent in nodes:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    redone = kill_step - (kill_step - 1) // save_every * save_every - 1 if kill else 0
    return {"wall": wall, "steps": redone, "gap": _longest_gap(log)}


def torchft(folder: Path, kill: bool, kill_step: int, save_every: int) -> dict[str, float]:
    port = free_port()
    lighthouse = subprocess.Popen([*DDPTRAIN, "lighthouse", "--bind", f"127.0.0.1:{port}", "--heartbeat-timeout-ms",
                                   "2000", "--join-timeout-ms", "1000"], stdout=subprocess.PIPE, env=_env(), text=True)
    if not select.select([lighthouse.stdout], [], [], 120)[0]:  # its first line: listening
        lighthouse.kill()
        raise SystemExit("ddptrain lighthouse printed nothing within 120 s")
    lighthouse.stdout.readline()  # type: ignore[union-attr]
    ft = ["--fault-tolerance", "torchft", "--replica-groups", "2", "--lighthouse", f"http://127.0.0.1:{port}",
          "--nproc", "1", "--max-restarts", "1", "--save-every", str(save_every)]
    try:
        log = folder / "steps"
        groups = []
        started = time.perf_counter()
        for group in (0, 1):
            env = _env(STEP_LOG=str(log)) if group == 0 else _env(
                **({"KILL_RANK": "0", "KILL_STEP": str(kill_step), "KILL_MARKER": str(folder / "killed")}
                   if kill else {}))
            groups.append(subprocess.Popen([*DDPTRAIN, "train", *JOB, *ft, "--replica-group", str(group), "--run-dir",
                                            str(folder / f"group-{group}")], env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True))
        first, _ = groups[0].communicate()
        wall = time.perf_counter() - started
        groups[1].communicate()
        left = re.findall(r"step (\d+): replica group 1 left", first)
        joined = re.findall(r"step (\d+): replica group 1 joined", first)
        # (a group that comes back after the other finished never rejoins: it missed the rest)
        missed = (int(joined[0]) if joined else STEPS) - int(left[0]) if left else 0
        return {"wall": wall, "steps": missed, "gap": _longest_gap(log)}
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--startup-s", type=float, default=5.0)
    args = parser.parse_args()
    os.environ["STARTUP_S"] = str(args.startup_s)
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for rep in range(args.reps):
        for name, run in (("restart", restart), ("elastic", elastic), ("torchft", torchft)):
            for kill in (False, True):
                with tempfile.TemporaryDirectory() as folder:
                    results.setdefault((name, kill), []).append(run(Path(folder), kill, args.kill_step,
                                                                    args.save_every))
                print(f"rep {rep + 1}/{args.reps}: {name}{' killed' if kill else ''} done", file=sys.stderr)

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    print(f"one failure at step {args.kill_step} of {STEPS}, snapshots every {args.save_every} steps, a start "
          f"{args.startup_s:g} s longer, {args.reps} repetition(s); seconds: median (range)")
    print(f"{'':10} {'wall, uninterrupted':>22} {'wall, one failure':>22} {'lost per failure':>22} "
          f"{'steps redone/missed':>20} {'longest wait':>18}")
    for name in ("restart", "elastic", "torchft"):
        calm, hit = results[(name, False)], results[(name, True)]
        lost = [h["wall"] - c["wall"] for c, h in zip(calm, hit)]
        print(f"{name:10} {spread([c['wall'] for c in calm]):>22} {spread([h['wall'] for h in hit]):>22} "
              f"{spread(lost):>22} {statistics.median(h['steps'] for h in hit):>20.0f} "
              f"{spread([h['gap'] for h in hit]):>18}")


if __name__ == "__main__":
    main()
