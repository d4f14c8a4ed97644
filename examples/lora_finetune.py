"""Fine-tuning with LoRA (PEFT) on ddptrain: the small GPT-2 of ``hf_causal_lm.py``, trained
once on some of the standard library's source, then adapted to new text (other modules of it:
``difflib`` and ``heapq``) by low-rank adapters on its attention and MLP projections, every
other weight frozen.

    pip install 'ddptrain[lora]'
    # 1. a base model to start from (any save_pretrained GPT-2 folder does)
    cd examples && ddptrain train --task hf_causal_lm:gpt2_task --max-epochs 2 --run-dir runs/base
    ddptrain export runs/base --format hf --out base-gpt2
    # 2. LoRA on it: only the adapters train, under ddp or fsdp
    LORA_BASE=base-gpt2 ddptrain train --task lora_finetune:lora_task --run-dir runs/lora
    # 3. the adapter PEFT loads (adapter_config.json + adapter_model.safetensors), or the merged model
    ddptrain export runs/lora --format hf --out lora-adapter
    ddptrain export runs/lora --format hf --merge --out lora-merged

Frozen weights get no gradient: DDP never waits for them (no unused-parameter error), FSDP2
reduce-scatters only the adapters' gradients, the optimizer holds state for the adapters only.
Snapshots hold the whole model (base and adapters), so a resume is bitwise on any strategy.
"""

import difflib
import heapq
import inspect
import os
import warnings

import torch

import ddptrain

from hf_causal_lm import ByteChunks, collate, evaluate, step

# GPT-2's projections (Conv1D) in each block: attention's qkv (c_attn) and output (c_proj), the MLP's
# (c_fc, and its own c_proj): 4 adapted layers a block
ADAPTED = ("c_attn", "c_proj", "c_fc")


def new_text() -> bytes:
    """Text the base never saw: two more modules of the standard library."""
    return "".join(inspect.getsource(module) for module in (difflib, heapq)).encode()


def base_model(cfg: ddptrain.RunConfig) -> torch.nn.Module:
    """LORA_BASE's save_pretrained folder, else hf_causal_lm's GPT-2 as ddptrain seeds it (for a
    quick look without step 1)."""
    folder = os.environ.get("LORA_BASE")
    if not folder:
        from hf_causal_lm import gpt2_task

        return gpt2_task(cfg).model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # one "Loading weights" bar per rank
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.loss_type = "ForCausalLM"
    return model


def lora_task(cfg: ddptrain.RunConfig) -> ddptrain.Task:
    from peft import LoraConfig, get_peft_model

    adapters = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(ADAPTED),
                          fan_in_fan_out=True,  # GPT-2's Conv1D stores its weight transposed
                          task_type="CAUSAL_LM", base_model_name_or_path=os.environ.get("LORA_BASE"))
    with warnings.catch_warnings():  # PEFT asks transformers 5 a name it deprecated (is_gradient_checkpointing)
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        model = get_peft_model(base_model(cfg), adapters)  # freezes every weight but the adapters
    chunks = ByteChunks(new_text())
    cut = len(chunks) * 9 // 10
    return ddptrain.Task(
        model=model,
        train_set=torch.utils.data.Subset(chunks, range(cut)),
        eval_set=torch.utils.data.Subset(chunks, range(cut, len(chunks))),
        collate_fn=collate,
        step_fn=step,
        eval_fn=evaluate,
        blocks=lambda model: list(model.base_model.model.transformer.h),  # for --strategy fsdp
        defaults={"optimizer": "adamw", "lr": 1e-2},
    )
