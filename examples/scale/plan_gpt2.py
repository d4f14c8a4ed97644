"""GPT-2 (124M) on an OpenWebText-sized set of 1,024-token sequences, for ``ddptrain plan``.

    cd examples/scale
    ddptrain plan --task plan_gpt2:gpt2_124m --strategy fsdp --nnodes 128 --nproc-per-node 8 \\
        --batch-size 1 --optimizer adamw

(In its own folder: examples/nanogpt's stand-in corpus is every file directly in examples/.)

The data set is as long as nanoGPT's OpenWebText (9.0B tokens: 8.8M sequences) and makes each
sequence from its index when asked, so a plan, which reads only the few micro-batches it runs,
needs no download; train on your own token file (``ddptrain.data.token_file``) for real.
(pip install 'ddptrain[examples]' for transformers.)
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

import ddptrain

SEQUENCE = 1024
OPENWEBTEXT_TOKENS = 9_035_582_198  # nanoGPT's data/openwebtext/prepare.py: train.bin


class IndexedTokens(Dataset):
    """``length`` sequences of GPT-2 token ids, each drawn from a generator seeded by its index."""

    def __init__(self, length: int, vocab: int) -> None:
        self.length, self.vocab = length, vocab

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(index)
        return torch.randint(self.vocab, (SEQUENCE,), generator=generator)


def next_token(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def gpt2_124m(cfg: ddptrain.RunConfig) -> ddptrain.Task:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_positions=SEQUENCE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # 124M
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # built from a config, not from_pretrained: name the loss
    return ddptrain.Task(model=model, train_set=IndexedTokens(OPENWEBTEXT_TOKENS // SEQUENCE, config.vocab_size),
                         step_fn=next_token, blocks=lambda m: list(m.transformer.h),
                         tokens_per_sample=SEQUENCE)
