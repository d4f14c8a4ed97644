"""A task whose rank DESYNC_RANK calls collectives the others do not, at step DESYNC_STEP
(``--task desync_tasks:desync``), as a bug in a user's loss would. DESYNC_KIND:

- ``extra``: that rank calls one all_reduce more than the others;
- ``gather``: it calls all_gather where the others call all_reduce;
- ``shape``: its all_reduce has another shape ([7] where the others reduce [4]).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ddptrain import Task
from ddptrain.tasks import regression_task

from kills import _on_step, _rank


def desync(cfg) -> Task:
    kind, rank, step = os.environ["DESYNC_KIND"], int(os.environ["DESYNC_RANK"]), int(os.environ["DESYNC_STEP"])

    def call_collectives(n: int) -> None:
        if n != step:
            return
        if _rank() != rank:
            if kind != "extra":
                dist.all_reduce(torch.ones(4))
        elif kind == "extra":
            dist.all_reduce(torch.ones(4))
        elif kind == "gather":
            dist.all_gather([torch.empty(4) for _ in range(dist.get_world_size())], torch.ones(4))
        else:
            dist.all_reduce(torch.ones(7))
    return _on_step(regression_task(cfg), call_collectives)
