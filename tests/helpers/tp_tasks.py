"""Tasks for --tp (tests/integration/test_parallel_tp.py): block_tasks' transformer-shaped model
(a Llama-shaped block: attention with separate q, k, v and o, a gated MLP; a nanoGPT-shaped one:
a GELU MLP) with a plan that splits the attention's q, k, v and the MLPs' up and gate column-wise,
o and down row-wise; the LayerNorms and the head stay whole. And a small Hugging Face Llama
(``llama``), whose plan is its own (``tp_plan``: its embedding split by vocabulary, its LM head's
logits gathered whole, the attention's 4 heads and 2 key-value heads split with q, k, v; its head
and embedding one tied weight), its loss a (sum, count) of the tokens it predicts."""

from __future__ import annotations

import dataclasses

import torch
from block_tasks import blocks as whole_blocks
from torch.utils.data import TensorDataset

from ddptrain import Task

from kills import killable

PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.o": "rowwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.gate": "colwise",
        "blocks.*.mlp.down": "rowwise"}


def blocks(cfg) -> Task:
    return dataclasses.replace(whole_blocks(cfg), tp_plan=PLAN)


killable_blocks = killable(blocks)


def llama_model():
    """A 2-layer Llama, 32 wide, over 64 tokens (the heads: 4 of q, 2 of k and v), its head tied to
    its token embedding (as Llama 3.2's small models are): one weight both layers of the plan split."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                        bos_token_id=0, eos_token_id=1, pad_token_id=None))


def llama(cfg) -> Task:
    """The Llama on 200 random sequences of 16 tokens (the last step of an epoch partial at 32 a
    step); its loss a (sum, count) over the next tokens but token 0, never a target (each batch a
    different count); no tp_plan: --tp takes the model's own."""
    torch.manual_seed(cfg.seed)
    model = llama_model()
    tokens = torch.randint(0, 64, (200, 16), generator=torch.Generator().manual_seed(cfg.seed))
    return Task(model=model, train_set=TensorDataset(tokens), step_fn=_next_tokens,
                defaults={"optimizer": "adamw", "lr": 3e-3})


def _next_tokens(model: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    (tokens,) = batch
    logits = model(input_ids=tokens).logits[:, :-1]
    targets = tokens[:, 1:].masked_fill(tokens[:, 1:] == 0, -100)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss, (targets != -100).sum()
