"""Task for benchmarks/gpu_check.sh: the benchmark's MLP job through the DataLoader path."""

import torch

from ddptrain import Task
from ddptrain.bench_loops import bench_task


class _Plain(torch.utils.data.Dataset):
    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.inner[index]


def mlp_via_dataloader(cfg) -> Task:
    task = bench_task(cfg)
    task.train_set = _Plain(task.train_set)
    return task
