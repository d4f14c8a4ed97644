"""A Hugging Face transformer on ddptrain: a small GPT-2 (random weights, nothing downloaded)
learning byte-level language modelling on text that ships with Python (the standard
library's own source). Dict batches, a collate_fn, step_fn and eval_fn.

    pip install 'ddptrain[hf]'
    python examples/hf_causal_lm.py --max_epochs 3              # from Python: ddptrain.fit
    cd examples && ddptrain train --task hf_causal_lm:gpt2_task  # or the command line

``gpt2_lines_task`` trains on lines of different lengths, padded: its step_fn returns the
loss as (sum over real tokens, token count), so each step is the mean over the global
batch's tokens, exactly, on any number of ranks.

``gpt2_tokens_task`` trains on a token file larger than memory (``ddptrain.data.TokenFile``,
nanoGPT's ``.bin``), counted in steps:

    python examples/write_tokens.py --out tokens.bin --repeat 100
    python examples/hf_causal_lm.py --tokens tokens.bin --max_steps 200
"""

import argparse
import inspect
import json
import os
import textwrap

import torch
from torch.utils.data import Dataset

import ddptrain

SEQUENCE = 64  # bytes per sample (the model's context)


def corpus() -> bytes:
    """Some 100 KB of English and Python from the standard library (the same on every machine
    with the same Python)."""
    return "".join(inspect.getsource(module) for module in (textwrap, json.decoder, argparse)).encode()


class ByteChunks(Dataset):
    """Consecutive SEQUENCE-byte chunks of ``data``, as dicts (Hugging Face style)."""

    def __init__(self, data: bytes) -> None:
        tokens = torch.tensor(list(data), dtype=torch.long)
        self.chunks = tokens[: len(tokens) // SEQUENCE * SEQUENCE].view(-1, SEQUENCE)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.chunks[index]}


def collate(samples: list[dict]) -> dict:
    """Stack the samples; a causal LM's labels are its inputs (the model shifts them)."""
    input_ids = torch.stack([s["input_ids"] for s in samples])
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}


def step(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


class ByteLines(Dataset):
    """The corpus's non-empty lines (at most SEQUENCE bytes each): samples of different lengths."""

    def __init__(self, data: bytes) -> None:
        self.lines = [torch.tensor(list(line[:SEQUENCE])) for line in data.splitlines() if len(line.strip()) > 1]

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.lines[index]}


def collate_padded(samples: list[dict]) -> dict:
    """Pad to the longest line; padding is masked out of attention and of the labels (-100)."""
    ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s["input_ids"]) for s in samples], batch_first=True)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def token_sum_step(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss as (sum over the batch's real tokens, their count): ddptrain divides by the
    count of the whole global step, so every token weighs the same however the lines are
    spread over ranks and micro-batches (a mean per batch would weigh short lines more)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    total = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets,
                                              ignore_index=-100, reduction="sum")
    return total, (targets != -100).sum()


@torch.no_grad()
def evaluate_tokens(model: torch.nn.Module, batch: dict) -> dict:
    """Per-batch sums; "samples" is what ddptrain divides by: here, tokens."""
    total, tokens = token_sum_step(model, batch)
    return {"loss": total, "samples": tokens}


@torch.no_grad()
def evaluate(model: torch.nn.Module, batch: dict) -> dict:
    """Per-batch sums: ddptrain adds them over ranks and divides by "samples"."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets,
                                                  reduction="none")
    per_sequence = per_token.mean(dim=1)
    return {"loss": per_sequence.sum(), "perplexity": per_sequence.exp().sum(), "samples": len(per_sequence)}


def gpt2_task(cfg: ddptrain.RunConfig) -> ddptrain.Task:
    from transformers import GPT2Config, GPT2LMHeadModel

    # bytes are the tokens: 256 of them, and no special ones (byte 0 stands in for GPT-2's 50256)
    config = GPT2Config(vocab_size=256, n_positions=SEQUENCE, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # seeded by ddptrain: the same initial weights on every rank
    model.loss_type = "ForCausalLM"  # a model built from a config, not from_pretrained, names no loss
    chunks = ByteChunks(corpus())
    cut = len(chunks) * 9 // 10
    return ddptrain.Task(
        model=model,
        train_set=torch.utils.data.Subset(chunks, range(cut)),
        eval_set=torch.utils.data.Subset(chunks, range(cut, len(chunks))),
        collate_fn=collate,
        step_fn=step,
        eval_fn=evaluate,
        blocks=lambda model: list(model.transformer.h),  # for --strategy fsdp / --activation-checkpointing
        defaults={"optimizer": "adamw", "lr": 2e-3},
    )


def gpt2_lines_task(cfg: ddptrain.RunConfig) -> ddptrain.Task:
    """The same model on lines of different lengths, padded, with a loss averaged over tokens."""
    task = gpt2_task(cfg)
    lines = ByteLines(corpus())
    cut = len(lines) * 9 // 10
    task.train_set = torch.utils.data.Subset(lines, range(cut))
    task.eval_set = torch.utils.data.Subset(lines, range(cut, len(lines)))
    task.collate_fn, task.step_fn, task.eval_fn = collate_padded, token_sum_step, evaluate_tokens
    return task


def next_token_step(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    """A TokenFile batch is (inputs, targets): targets are the inputs shifted by one token."""
    inputs, targets = batch
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def evaluate_next_token(model: torch.nn.Module, batch: tuple) -> dict:
    inputs, _ = batch
    return {"loss": next_token_step(model, batch) * len(inputs), "samples": len(inputs)}


def gpt2_tokens_task(cfg: ddptrain.RunConfig) -> ddptrain.Task:
    """The same model on the token file HF_CAUSAL_LM_TOKENS (byte ids, uint16), windows of
    SEQUENCE tokens; the last 1% of the windows (at most 512) are held out for evaluation."""
    from ddptrain.data import TokenFile

    task = gpt2_task(cfg)
    windows = TokenFile(os.environ["HF_CAUSAL_LM_TOKENS"], seq_len=SEQUENCE)
    held_out = min(512, max(1, len(windows) // 100))
    task.train_set = torch.utils.data.Subset(windows, range(len(windows) - held_out))
    task.eval_set = torch.utils.data.Subset(windows, range(len(windows) - held_out, len(windows)))
    task.collate_fn, task.step_fn, task.eval_fn = None, next_token_step, evaluate_next_token
    return task


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a small GPT-2 trained with ddptrain.fit")
    parser.add_argument("--max_epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--run_dir", default=None)
    parser.add_argument("--tokens", default=None, help="a token file (examples/write_tokens.py) to train on")
    parser.add_argument("--max_steps", type=int, default=None)
    args = parser.parse_args()
    if args.tokens:
        os.environ["HF_CAUSAL_LM_TOKENS"] = os.path.abspath(args.tokens)  # the ranks read it
    summary = ddptrain.fit(gpt2_tokens_task if args.tokens else gpt2_task, max_steps=args.max_steps,
                           max_epochs=None if args.max_steps else args.max_epochs, batch_size=args.batch_size,
                           run_dir=args.run_dir)
    if summary:
        perplexity = f", perplexity {summary['eval_perplexity']:.1f}" if "eval_perplexity" in summary else ""
        print(f"eval loss {summary['eval_loss']:.3f}{perplexity}")
