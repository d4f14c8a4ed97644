"""--tp's pure parts, in this process: a task's plan resolved against its model, and the settings
--tp refuses, one line each (the runs themselves: tests/integration/test_parallel_tp.py)."""

from __future__ import annotations

import pytest
from block_tasks import Model
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from tp_tasks import PLAN

from ddptrain import ConfigError, RunConfig, Task
from ddptrain.parallel.tensor_parallel import model_plan, resolve_plan
from ddptrain.settings.checks import validate


def test_a_plan_of_patterns_names_each_layer_of_every_block():
    plan = resolve_plan(Model(), PLAN, 2)
    layers = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.down")
    expected = {f"blocks.{i}.{layer}" for i in (0, 1) for layer in layers} | {"blocks.0.mlp.gate"}  # (1 has none)
    assert set(plan) == expected
    assert isinstance(plan["blocks.1.attn.q"], ColwiseParallel)
    assert isinstance(plan["blocks.0.mlp.down"], RowwiseParallel)


def test_a_hugging_face_model_s_own_plan_is_taken_when_the_task_names_none():
    """A Llama's tp_plan (its config's base_model_tp_plan under "model.", and its LM head's):
    HF's colwise_gather_output for the head (the logits gathered whole) and embedding_rowwise for
    the token embedding (split by vocabulary: its rows, the dimension checked)."""
    from tp_tasks import llama_model

    model = llama_model()
    plan = model_plan(Task(model=model, train_set=[0], loss_fn=len), model)
    assert plan is not None and plan["lm_head"] == "colwise_gather_output"
    styles = resolve_plan(model, plan, 2)
    head, embedding = styles["lm_head"], styles["model.embed_tokens"]
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)
    assert isinstance(embedding, RowwiseParallel) and embedding.input_layouts == (Replicate(),)
    assert isinstance(styles["model.layers.1.self_attn.o_proj"], RowwiseParallel)
    with pytest.raises(ConfigError, match=r"model.embed_tokens's num_embeddings \(64\) does not divide into 3"):
        resolve_plan(model, {"model.embed_tokens": "embedding_rowwise"}, 3)
    assert model_plan(Task(model=model, train_set=[0], loss_fn=len, tp_plan=PLAN), model) is PLAN
    assert model_plan(Task(model=Model(), train_set=[0], loss_fn=len), Model()) is None


@pytest.mark.parametrize("patterns,tp,words", [
    ({"blocks.*.attn.q": "sequence_parallel"}, 2, "style 'sequence_parallel' is not one ddptrain splits (yet)"),
    ({"blocks.*.atn.q": "colwise"}, 2, "Task.tp_plan['blocks.*.atn.q'] names no module of the model (its modules: "
                                       "blocks, blocks.0, blocks.0.norm1"),
    ({"blocks.*.attn": "colwise"}, 2, "blocks.0.attn is a Attention; a colwise split takes a Linear or an Embedding"),
    ({"blocks.*.mlp.down": "rowwise"}, 3, "--tp 3: blocks.0.mlp.down's in_features (64) does not divide into 3 parts"),
])
def test_a_plan_that_cannot_split_the_model_is_one_line(patterns, tp, words):
    with pytest.raises(ConfigError) as raised:
        resolve_plan(Model(), patterns, tp)
    assert words in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("settings,words", [
    ({"tp": 0}, "--tp must be at least 1, got 0"),
    ({"tp": 2}, "--tp 2 composes tensor parallelism with --strategy fsdp or hsdp (DDP cannot hold the split "
                "layers' DTensors)"),
    ({"tp": 2, "strategy": "fsdp", "compile": True}, "--tp 2 with --compile: not built yet"),
])
def test_settings_tp_does_not_take_yet_are_refused_in_one_line(settings, words):
    with pytest.raises(ConfigError) as raised:
        validate(RunConfig(**settings))
    assert words in str(raised.value), str(raised.value)


def test_the_global_batch_counts_the_data_parallel_ranks():
    """4 ranks in groups of 2 are 2 data-parallel ranks: batch 8 x 2 x accumulation 2; the
    fingerprint counts those (--tp itself is a layout: a resume may change it, the batch adapted)."""
    cfg = RunConfig(tp=2, strategy="fsdp", batch_size=8, grad_accum=2)
    assert cfg.data_ranks(4) == 2 and cfg.global_batch(cfg.data_ranks(4)) == 32
    assert RunConfig(strategy="fsdp", batch_size=8, grad_accum=2).global_batch(4) == 64


def test_a_plan_s_global_batch_counts_the_data_parallel_groups():
    """ddptrain plan --global-batch under --tp: the batch per rank over the target's groups, not
    its ranks (8 ranks in groups of 2: 4 x 16 = 64); one that does not divide says so in groups."""
    from ddptrain.plan.job import with_global_batch
    from ddptrain.plan.rank import Target

    cfg = RunConfig(tp=2, strategy="fsdp")
    assert with_global_batch(cfg, Target(8, 8), 64).batch_size == 16
    with pytest.raises(ConfigError, match=r"^--global-batch 66 does not divide over 4 data-parallel groups "
                                          r"\(--tp 2\) x --grad-accum 1; choose a multiple of 4 \(e\.g\. 64\)"):
        with_global_batch(cfg, Target(8, 8), 66)


def test_tied_weights_are_tied_again_after_each_layer_got_a_parameter_of_its_own():
    """parallelize_module gives each layer it splits a parameter of its own: a tied embedding and
    head (the Llama's) would train as two copies. retie points the head at the embedding's again,
    where both are split alike (their placements, here stand-ins on plain parameters); where they
    are not, one line."""
    import torch
    from tp_tasks import llama_model

    from ddptrain.parallel.tensor_parallel import retie, tied_parameters

    model = llama_model()
    tied = tied_parameters(model)
    assert tied == [[("model.embed_tokens", "weight"), ("lm_head", "weight")]]
    for placements in ("rows", "rows"), ("rows", "columns"):
        model.model.embed_tokens.weight.placements = placements[0]
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # what parallelize does
        model.lm_head.weight.placements = placements[1]
        if placements[0] == placements[1]:
            retie(model, tied)
            assert model.lm_head.weight is model.model.embed_tokens.weight
        else:
            with pytest.raises(ConfigError, match=r"^Task.tp_plan splits the tied weights model.embed_tokens.weight "
                                                  r"and lm_head.weight differently; split both by rows"):
                retie(model, tied)
