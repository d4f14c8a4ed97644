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

With ``--failures F`` (say 5), the failures follow a seeded schedule instead: the doomed rank,
node or group SIGKILLs itself at its N-th step of each attempt, N drawn from an exponential
distribution of mean ``--mean-steps`` (``--seed``), F times (the elastic path's node is
started again after each kill, as an orchestrator replaces a node). A second table gives each
path's goodput over every attempt, read from the run's timeline.jsonl (ddptrain report's
figure), and its parts: start-up, steps redone, waiting, the failure (its detection to the
attempt's end), between attempts.
"""

import argparse
import os
import random
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
from ddptrain.observe.goodput import account, read_timeline
from ddptrain.tasks import regression_task

BENCH = Path(__file__).resolve().parent
DDPTRAIN = [sys.executable, "-m", "ddptrain"]
STEPS = 192  # 6 epochs of 32
ELASTIC_GRACE_S = 2.0  # --elastic-grace: how long a surviving node's rendezvous waits for a replacement
JOB = ["--task", "fault_tolerance:paced", "--max-epochs", "6", "--batch-size", "32", "--save-seconds", "0"]


def paced(cfg) -> Task:
    """The job's task (run by the ranks): regression, each loss STEP_SLEEP s later, rank 0's
    times in STEP_LOG; rank KILL_RANK SIGKILLs itself at its N-th loss of an attempt, N the next
    of KILL_GAPS (comma-separated) not yet done (KILL_MARKERS holds a file per kill done), with
    KILL_NODE its whole process group (a torchrun agent started in a session of its own)."""
    time.sleep(float(os.environ.get("STARTUP_S", "0")))
    task = regression_task(cfg)
    rank, pause = int(os.environ["RANK"]), float(os.environ.get("STEP_SLEEP", "0.02"))
    log, markers = os.environ.get("STEP_LOG"), Path(os.environ.get("KILL_MARKERS", "/nonexistent"))
    gaps = [int(gap) for gap in os.environ.get("KILL_GAPS", "").split(",") if gap]
    done = len(list(markers.glob("killed-*")))
    killed = os.environ.get("KILL_RANK") in (str(rank), "any")  # any: whichever rank this process is
    kill_at = gaps[done] if killed and done < len(gaps) else 0
    victim = os.getpgid(0) if os.environ.get("KILL_NODE") else 0  # the node: its agent's process group
    calls = {"n": 0}
    loss_fn = task.loss_fn

    def counted(*args):
        calls["n"] += 1
        time.sleep(pause)
        if calls["n"] == kill_at:
            (markers / f"killed-{done}").write_text("killed")
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


def _doomed(rank: str, folder: Path, gaps: list[int]) -> dict[str, str]:
    """The variables that make ``rank`` ("any": the node's) fail on the schedule ``gaps``."""
    return {"KILL_RANK": rank, "KILL_GAPS": ",".join(map(str, gaps)), "KILL_MARKERS": str(folder)} if gaps else {}


def _kills(folder: Path) -> int:
    return len(list(folder.glob("killed-*")))


def _goodput(run_dir: Path) -> dict[str, float]:
    """The run's goodput and its parts, as `ddptrain report` reads them from timeline.jsonl."""
    found = account(read_timeline(run_dir))
    if found is None:
        raise SystemExit(f"{run_dir}: no timeline.jsonl")
    return found


def restart(folder: Path, gaps: list[int], save_every: int) -> dict[str, float]:
    log = folder / "steps"
    env = _env(STEP_LOG=str(log), **_doomed("1", folder, gaps))
    started = time.perf_counter()
    subprocess.run([*DDPTRAIN, "train", *JOB, "--nproc", "2", "--max-restarts", str(max(len(gaps), 1)),
                    "--save-every", str(save_every), "--run-dir", str(folder / "run")],
                   env=env, check=True, capture_output=True)
    wall = time.perf_counter() - started
    found = _goodput(folder / "run")
    return {"wall": wall, "steps": found["steps_redone"], "gap": _longest_gap(log), "kills": _kills(folder), **found}


def elastic(folder: Path, gaps: list[int], save_every: int) -> dict[str, float]:
    """Two torchrun agents of one rank each. The surviving agent's rendezvous after a failure
    waits up to ELASTIC_GRACE_S (its ``last_call_timeout``) for more nodes: a replacement that
    joins within it is in the same round, so the survivor restarts once per failure, not twice
    (alone when the node goes, again when its replacement comes)."""
    log, port = folder / "steps", free_port()
    env = _env(STEP_LOG=str(log), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    doomed = {**_doomed("any", folder, gaps), "KILL_NODE": "1"} if gaps else {}
    restarts = str(2 * len(gaps) + 1)  # the host's ranks restart when the node goes, and when it comes back

    def node(host: bool) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
             f"--max-restarts={restarts}", "--monitor-interval=1", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench",
             f"--rdzv-conf=is_host={int(host)},last_call_timeout={ELASTIC_GRACE_S:g}", "-m", "ddptrain", "train", *JOB,
             "--save-every", str(save_every), "--run-dir", str(folder / "run")],
            env={**env, **({} if host else doomed)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a process group per node: KILL_NODE takes the agent with its rank

    started = time.perf_counter()
    nodes = [node(host=True), node(host=False)]
    replaced = 0
    try:
        while nodes[0].poll() is None:
            if time.perf_counter() - started > 600:
                raise SystemExit("elastic: the job did not end within 600 s")
            if len(gaps) > 1 and nodes[1].poll() is not None and _kills(folder) > replaced:
                nodes[1] = node(host=False)  # the orchestrator replaces the failed node
                replaced += 1
            time.sleep(0.1)
        if nodes[0].returncode != 0:
            raise SystemExit(f"elastic: the first node's torchrun exited {nodes[0].returncode}")
        wall = time.perf_counter() - started
    finally:
        for agent in nodes:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    found = _goodput(folder / "run")
    return {"wall": wall, "steps": found["steps_redone"], "gap": _longest_gap(log), "kills": _kills(folder), **found}


def torchft(folder: Path, gaps: list[int], save_every: int) -> dict[str, float]:
    port = free_port()
    lighthouse = subprocess.Popen([*DDPTRAIN, "lighthouse", "--bind", f"127.0.0.1:{port}", "--heartbeat-timeout-ms",
                                   "2000", "--join-timeout-ms", "1000"], stdout=subprocess.PIPE, env=_env(), text=True)
    if not select.select([lighthouse.stdout], [], [], 120)[0]:  # its first line: listening
        lighthouse.kill()
        raise SystemExit("ddptrain lighthouse printed nothing within 120 s")
    lighthouse.stdout.readline()  # type: ignore[union-attr]
    ft = ["--fault-tolerance", "torchft", "--replica-groups", "2", "--lighthouse", f"http://127.0.0.1:{port}",
          "--nproc", "1", "--save-every", str(save_every)]
    try:
        log = folder / "steps"
        groups = []
        started = time.perf_counter()
        for group in (0, 1):
            env = _env(STEP_LOG=str(log)) if group == 0 else _env(**_doomed("0", folder, gaps))
            restarts = str(max(len(gaps), 1) if group == 1 else 1)
            groups.append(subprocess.Popen([*DDPTRAIN, "train", *JOB, *ft, "--max-restarts", restarts,
                                            "--replica-group", str(group), "--run-dir", str(folder / f"group-{group}")],
                                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        first, _ = groups[0].communicate()
        wall = time.perf_counter() - started
        groups[1].communicate()
        left = [int(step) for step in re.findall(r"step (\d+): replica group 1 left", first)]
        joined = [int(step) for step in re.findall(r"step (\d+): replica group 1 (?:joined|rejoined)", first)]
        # (a group that comes back after the other finished never rejoins: it missed the rest)
        missed = sum((joined[n] if n < len(joined) else STEPS) - step for n, step in enumerate(left))
        found = _goodput(folder / "group-0")  # the healthy group's: it trained on
        return {"wall": wall, "steps": missed, "gap": _longest_gap(log), "kills": _kills(folder), **found}
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)


def schedule(failures: int, mean_steps: float, seed: int, kill_step: int) -> list[int]:
    """The doomed rank's step of each attempt at which it fails: one at ``kill_step``, or
    ``failures`` drawn from an exponential distribution of mean ``mean_steps`` (at least 1)."""
    if failures == 0:
        return [kill_step]
    draw = random.Random(seed)
    return [max(1, round(draw.expovariate(1 / mean_steps))) for _ in range(failures)]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--startup-s", type=float, default=5.0)
    parser.add_argument("--failures", type=int, default=0, help="a schedule of this many failures (0: one, at "
                        "--kill-step)")
    parser.add_argument("--mean-steps", type=float, default=40.0, help="the schedule's mean steps between failures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", default="restart,elastic,torchft")
    parser.add_argument("--elastic-grace", type=float, default=ELASTIC_GRACE_S,
                        help="elastic: the rendezvous' last_call_timeout, how long a surviving node waits for a "
                        "replacement before it goes on alone (default 2)")
    args = parser.parse_args()
    globals()["ELASTIC_GRACE_S"] = args.elastic_grace
    os.environ["STARTUP_S"] = str(args.startup_s)
    gaps = schedule(args.failures, args.mean_steps, args.seed, args.kill_step)
    paths = {"restart": restart, "elastic": elastic, "torchft": torchft}
    names = args.paths.split(",")
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for rep in range(args.reps):
        for name in names:
            for kill in (False, True):
                with tempfile.TemporaryDirectory() as folder:
                    results.setdefault((name, kill), []).append(paths[name](Path(folder), gaps if kill else [],
                                                                            args.save_every))
                print(f"rep {rep + 1}/{args.reps}: {name}{' killed' if kill else ''} done", file=sys.stderr)

    failed = f"failures at steps {gaps} of each attempt" if args.failures else f"one failure at step {args.kill_step}"
    print(f"{failed} of {STEPS}, snapshots every {args.save_every} steps, a start {args.startup_s:g} s longer, "
          f"{args.reps} repetition(s); seconds: median (range)")
    print(f"{'':10} {'wall, uninterrupted':>22} {'wall, failures':>22} {'lost per failure':>22} "
          f"{'steps redone/missed':>20} {'longest wait':>18}")
    for name in names:
        calm, hit = results[(name, False)], results[(name, True)]
        lost = [(h["wall"] - c["wall"]) / max(h["kills"], 1) for c, h in zip(calm, hit)]
        print(f"{name:10} {spread([c['wall'] for c in calm]):>22} {spread([h['wall'] for h in hit]):>22} "
              f"{spread(lost):>22} {statistics.median(h['steps'] for h in hit):>20.0f} "
              f"{spread([h['gap'] for h in hit]):>18}")
    print("\ngoodput (timeline.jsonl; torchft: the healthy group's) and the failure runs' badput in seconds")
    parts = ("startup_s", "steps_redone_s", "waiting_s", "failure_s", "between_attempts_s", "snapshots_s")
    print(f"{'':10} {'failures':>8} {'goodput, none':>20} {'goodput, failures':>20} "
          + " ".join(f"{part.removesuffix('_s').replace('_', ' '):>20}" for part in parts))
    for name in names:
        calm, hit = results[(name, False)], results[(name, True)]
        print(f"{name:10} {statistics.median(h['kills'] for h in hit):>8.0f} "
              f"{spread([c['goodput'] for c in calm]):>20} {spread([h['goodput'] for h in hit]):>20} "
              + " ".join(f"{spread([h[part] for h in hit]):>20}" for part in parts))


if __name__ == "__main__":
    main()
