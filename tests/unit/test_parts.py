"""The run's parts are built one at a time, each from its settings and the parts it is given
(parts.py): a test builds the one it is about, without a process group or the rest of the run."""

import torch

from ddptrain.comm import DistContext
from ddptrain.data import TrainBatches
from ddptrain.parts import build_batches, build_evaluations, build_optimizing, make_cadence, recorded
from ddptrain.progress import Progress
from ddptrain.run_dir import RunDir
from ddptrain.settings import RunConfig
from ddptrain.snapshots.best import BestModel
from ddptrain.tasks.digits import digits_task


def rank(r: int, world: int) -> DistContext:
    return DistContext(rank=r, world_size=world, local_rank=r, local_world_size=world, device=torch.device("cpu"),
                       backend="gloo")


class _NoStrategy:  # what build_evaluations reads of a strategy: whether its forward holds a collective,
    forward_syncs = False  # and the ranks the data is split over (every rank's own but under --tp)

    @staticmethod
    def data_context(ctx: DistContext) -> DistContext:
        return ctx


def test_the_batches_the_optimizer_and_the_cadence_each_from_their_own_settings():
    cfg = RunConfig(task="digits", batch_size=8, grad_accum=2, max_epochs=3, optimizer="adamw", lr=0.01, ema=0.9,
                    betas="0.9,0.95")
    task = digits_task(cfg)
    batches = [build_batches(task, cfg, rank(r, 2), None) for r in range(2)]
    assert all(isinstance(b, TrainBatches) for b in batches)
    assert batches[0].steps_per_epoch == -(-len(task.train_set) // (8 * 2 * 2))  # (a short last step: no padding)
    mine = [[m.samples for m in b.sampler.micro_batches(b.sampler.order())] for b in batches]
    assert sum(map(sum, mine)) == len(task.train_set)  # the two ranks' shares cover the set once

    optimizer, average, scaler = build_optimizing(task, cfg, rank(0, 2), task.model, list(task.model.parameters()))
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    assert average is not None and not scaler.is_enabled()  # (fp16's scaler: CUDA only)

    progress = Progress(steps_per_epoch=batches[0].steps_per_epoch)
    cadence = make_cadence(cfg, progress, evaluates=True, best=BestModel("eval_loss", patience=1))
    assert not cadence.done()
    assert recorded(cfg, 2, task)["global_batch"] == 32 and recorded(cfg, 4, task)["global_batch"] == 64


def test_the_evaluations_of_a_subset_are_the_same_samples_on_every_world_size(tmp_path):
    cfg = RunConfig(task="digits", batch_size=16, eval_batches=3, run_dir=str(tmp_path))
    task = digits_task(cfg)

    def shares(world: int) -> list[tuple[float, ...]]:
        found = []
        for r in range(world):
            evaluations = build_evaluations(task, cfg, rank(r, world), _NoStrategy(), task.model, task.model, None,
                                            None, RunDir.of(str(tmp_path)), None, lambda: None)
            assert evaluations.subset and evaluations.whole is not None  # (--final-eval full: the whole set last)
            found += [tuple(image.tolist()) for _, (images, _) in evaluations.batches for image in images]
        return sorted(found)

    assert len(set(shares(1))) == 48 and shares(1) == shares(2) == shares(3)
