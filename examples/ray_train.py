"""ddptrain under Ray Train: ``python examples/ray_train.py --run-dir /shared/runs/ray-demo``.

Ray starts the workers (CPU processes with gloo here, GPUs with ``--gpu``) and their process
group, and restarts the whole group after a worker fails (``--max-failures``). Each worker
calls ``ddptrain.fit()``, which trains as that rank on Ray's group and, after a restart,
resumes from ddptrain's newest snapshot: bitwise the run that never failed. The run dir must
be storage every worker sees (one machine: any folder; a cluster: a shared file system or
``s3://bucket/prefix``). Needs ``pip install 'ddptrain[ray]'``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import ddptrain
from ddptrain.observe.ray_train import POINTER


def train_worker(config: dict) -> None:
    """Every Ray worker: one rank of the ddptrain job, on the process group Ray made."""
    ddptrain.fit(config["task"], run_dir=config["run_dir"], **config["options"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, help="ddptrain's run dir, seen by every worker")
    parser.add_argument("--task", default="regression")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--max-failures", type=int, default=1, help="restarts of the worker group Ray allows")
    parser.add_argument("--storage", default=str(Path.home() / "ray_results"), help="Ray's own results")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--momentum", type=float, default=0.9)
    args = parser.parse_args()

    ray.init(num_cpus=args.workers, include_dashboard=False)  # a local cluster; on a cluster: ray.init()
    options = {"max_epochs": args.max_epochs, "save_every": args.save_every, "momentum": args.momentum}
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"task": args.task, "run_dir": str(Path(args.run_dir).resolve()), "options": options},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=RunConfig(name="ddptrain", storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=args.max_failures)),
    )
    result = trainer.fit()
    snapshot = None
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as folder:
            snapshot = json.loads((Path(folder) / POINTER).read_text())
    print(json.dumps({"error": str(result.error) if result.error else None, "ray_checkpoint": snapshot}))


if __name__ == "__main__":
    main()
