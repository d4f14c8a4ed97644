"""Tasks whose FSDP wrapping differs from the default (Task.blocks)."""

from ddptrain.tasks.digits import digits_task

from kills import killable


def rooted_digits(cfg):
    """digits with one block, its middle layer: the first and last layers are the root's, which
    FSDP keeps gathered after a forward without a backward (an evaluation). The same model and
    data as digits: under ddp, the same run."""
    task = digits_task(cfg)
    task.blocks = lambda model: [model[2]]
    return task


kill_rooted_digits = killable(rooted_digits)
