"""A transformer-shaped task: a Llama-shaped block (attention with separate q, k, v and o, no
biases, then a gated MLP) and a nanoGPT-shaped one (a GELU MLP), with residual connections and
LayerNorms, on sequences of 6 vectors of 16 features regressed to one number. Its backward sums
gradients from several branches, whose rounding torch's FlopCounterMode changes (observe/
throughput.FlopCount): the model the bitwise resume of such models is tested on.

- BLOCK_SAMPLES: the training set's size (default 601: an epoch's last step is partial).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from ddptrain import Task

from kills import killable

DIM, HEADS, SEQUENCE = 16, 4, 6


class Attention(torch.nn.Module):
    """Causal self-attention, its heads counted from q's output (``-1``): a share of q's features
    is a share of the heads."""

    def __init__(self) -> None:
        super().__init__()
        # no biases, as Llama's: a key's bias has no gradient (softmax ignores a shift of a row's
        # logits), and AdamW would turn the reduction order's rounding there into whole steps
        self.q, self.k, self.v, self.o = (torch.nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape
        q, k, v = (part(x).view(batch, steps, -1, DIM // HEADS).transpose(1, 2) for part in (self.q, self.k, self.v))
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(mixed.transpose(1, 2).reshape(batch, steps, -1))


class GatedMLP(torch.nn.Module):
    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(DIM, 4 * DIM), torch.nn.Linear(4 * DIM, DIM)
        self.gate = torch.nn.Linear(DIM, 4 * DIM) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.gate(x)) * self.up(x) if self.gate is not None else F.gelu(self.up(x))
        return self.down(hidden)


class Block(torch.nn.Module):
    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), GatedMLP(gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(gated=True), Block(gated=False)])
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def _data(seed: int, samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, SEQUENCE, DIM, generator=generator)
    return TensorDataset(inputs, inputs[:, :, :3].sum(dim=(1, 2)).unsqueeze(1) / 4)


def blocks(cfg) -> Task:
    torch.manual_seed(cfg.seed)
    return Task(model=Model(), train_set=_data(cfg.seed, int(os.environ.get("BLOCK_SAMPLES", "601"))),
                eval_set=_data(cfg.seed + 1, 75), loss_fn=F.mse_loss,
                defaults={"optimizer": "adamw", "lr": 3e-3})


killable_blocks = killable(blocks)
