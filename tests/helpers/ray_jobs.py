"""The Ray Train tests' driver: one local Ray cluster (2 CPUs), then the jobs the test names,
each a TorchTrainer over examples/ray_train.py's worker function; prints one JSON line per job.

    python ray_jobs.py RUN_DIR STORAGE (resumed|unshared|in-ray-storage) ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from ray_train import POINTER, train_worker  # noqa: E402 - the example's own worker function

OPTIONS = {"max_epochs": 3, "save_every": 32, "momentum": 0.9}


def own_run_dir_worker(config: dict) -> None:
    """Each worker given a run dir of its own: storage only one worker can see."""
    import ray.train

    config = {**config, "run_dir": f"{config['run_dir']}/rank-{ray.train.get_context().get_world_rank()}"}
    train_worker(config)


def ray_storage_worker(config: dict) -> None:
    """fit() without a run dir: the run lives in Ray's storage for the job."""
    import ddptrain

    ddptrain.fit(config["task"], **config["options"])


def run(name: str, worker, run_dir: Path, storage: str, task: str, max_failures: int, **options) -> dict:
    config = {"task": task, "run_dir": str(run_dir), "options": {**OPTIONS, **options}}
    trainer = TorchTrainer(worker, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name=name, storage_path=storage,
                                                failure_config=FailureConfig(max_failures=max_failures)))
    try:
        result = trainer.fit()
    except Exception as error:  # noqa: BLE001 - Ray raises the workers' failure here
        return {"job": name, "error": str(error)}
    pointer = None
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as folder:
            pointer = json.loads((Path(folder) / POINTER).read_text())
    return {"job": name, "error": str(result.error) if result.error else None, "ray_checkpoint": pointer}


def main() -> None:
    base, storage, *jobs = sys.argv[1:]
    ray.init(num_cpus=2, include_dashboard=False)
    for job in jobs:
        if job == "resumed":
            # --resume never: the job's first start is fresh, and Ray's restart of it resumes its snapshots
            outcome = run(job, train_worker, Path(base) / job, storage, "ddptrain_test_tasks:kill_at_step", 1,
                          resume="never")
        elif job == "in-ray-storage":
            outcome = run(job, ray_storage_worker, Path(base) / job, storage, "regression", 0)
        else:
            outcome = run(job, own_run_dir_worker, Path(base) / job, storage, "regression", 0)
        print("RESULT " + json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
