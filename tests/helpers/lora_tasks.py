"""examples/lora_finetune.py's LoRA task, small enough for the tests: the adapters on a fixed
GPT-2 base (LORA_BASE, a save_pretrained folder the test writes), its first 96 chunks."""

from __future__ import annotations

import sys
from pathlib import Path

from torch.utils.data import Subset

from ddptrain import Task

from kills import killable

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))


def small_lora(cfg) -> Task:
    import lora_finetune

    task = lora_finetune.lora_task(cfg)
    task.train_set = Subset(task.train_set, range(96))
    return task


kill_small_lora = killable(small_lora)
