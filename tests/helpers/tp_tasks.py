"""Tasks for --tp (tests/integration/test_parallel_tp.py): block_tasks' transformer-shaped model
(a Llama-shaped block: attention with separate q, k, v and o, a gated MLP; a nanoGPT-shaped one:
a GELU MLP) with a plan that splits the attention's q, k, v and the MLPs' up and gate column-wise,
o and down row-wise; the LayerNorms and the head stay whole."""

from __future__ import annotations

import dataclasses

from block_tasks import blocks as whole_blocks

from ddptrain import Task

from kills import killable

PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.o": "rowwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.gate": "colwise",
        "blocks.*.mlp.down": "rowwise"}


def blocks(cfg) -> Task:
    return dataclasses.replace(whole_blocks(cfg), tp_plan=PLAN)


killable_blocks = killable(blocks)
