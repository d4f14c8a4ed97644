"""LoRA fine-tuning with PEFT (examples/lora_finetune.py) under ddp and fsdp: only the adapters
change, the optimizer holds state for them alone, a kill resumes bitwise, and the adapter
``export --format hf`` writes is what PEFT loads onto the base."""

import pytest
import torch

from ddptrain import RunConfig, TrainingFailed
from ddptrain.snapshots import files
from helpers.commands import assert_ok, assert_same_weights, ddptrain_cli, fit, load_model

pytest.importorskip("peft", reason="the lora extra (pip install 'ddptrain[lora]') is not installed")
import lora_tasks  # noqa: E402 - imports examples/ (after peft is known to be there)

pytestmark = pytest.mark.slow
TASKS = "lora_tasks:"
ARGS = {"max_epochs": 2, "batch_size": 16, "save_every": 2, "lr": 0.01}  # 3 steps an epoch on 2 ranks
ADAPTERS = 2 * 4 * 2  # 2 blocks x (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) x (lora_A, lora_B)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A GPT-2 "pretrained" elsewhere: hf_causal_lm's, seeded, as save_pretrained writes it."""
    import hf_causal_lm

    folder = tmp_path_factory.mktemp("base-gpt2")
    torch.manual_seed(0)
    hf_causal_lm.gpt2_task(RunConfig(task="base")).model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    for strategy in ("ddp", "fsdp"):
        fit(TASKS + "small_lora", root / strategy, env={"LORA_BASE": str(base)}, strategy=strategy, **ARGS)
    return root


def _base_weights(base):
    from safetensors.torch import load_file

    return load_file(str(base / "model.safetensors"))


def _as_base_name(key):
    """PEFT's name of a base weight -> the base model's (the adapted layer moves to .base_layer)."""
    return key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def test_only_the_adapters_train_and_only_they_hold_optimizer_state(runs, base):
    before = _base_weights(base)
    for strategy in ("ddp", "fsdp"):
        after = load_model(runs / strategy)
        adapters = [k for k in after if ".lora_" in k]
        assert len(adapters) == ADAPTERS
        assert all(after[k].abs().sum() > 0 for k in adapters if ".lora_B." in k)  # PEFT starts B at 0
        frozen = {_as_base_name(k): v for k, v in after.items() if k not in adapters}
        frozen.pop("lm_head.weight")  # tied to wte: save_pretrained stores it once
        assert frozen.keys() == before.keys()
        assert all(torch.equal(frozen[k], before[k]) for k in before), strategy
    assert_same_weights(load_model(runs / "fsdp"), load_model(runs / "ddp"))  # allclose
    snapshot = files.load_snapshot(files.list_snapshots(runs / "ddp" / "snapshots")[-1])
    assert len(snapshot["optimizer"]["state"]) == ADAPTERS  # AdamW's moments: the adapters' only


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_lora_run_killed_and_resumed_ends_bitwise(runs, base, tmp_path, strategy):
    run_dir = tmp_path / "run"
    env = {"LORA_BASE": str(base), "KILL_RANK": "1", "KILL_STEP": "5",  # step 5 of 6 (eval_fn is not counted)
           "KILL_MARKER": str(tmp_path / "killed"), "KILL_ONCE_SAVED": str(run_dir / "snapshots")}
    with pytest.raises(TrainingFailed):
        fit(TASKS + "kill_small_lora", run_dir, env=env, strategy=strategy, **ARGS)
    fit(TASKS + "kill_small_lora", run_dir, env=env, strategy=strategy, **ARGS)
    assert_same_weights(load_model(run_dir), load_model(runs / strategy), exact=True)


def _logits(model, tokens):
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT on transformers 5
def test_the_exported_adapter_loaded_by_peft_gives_the_trained_models_logits(runs, base, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert_ok(ddptrain_cli("export", str(runs / "fsdp"), "--format", "hf", "--out", str(adapter)))
    assert_ok(ddptrain_cli("export", str(runs / "fsdp"), "--format", "hf", "--merge", "--out", str(merged)))
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}

    monkeypatch.setenv("LORA_BASE", str(base))
    trained = lora_tasks.small_lora(RunConfig(task="lora")).model
    trained.load_state_dict(load_model(runs / "fsdp"))  # strict: every tensor of the run
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    expected = _logits(trained, tokens)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    assert torch.equal(_logits(loaded, tokens), expected)
    assert torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(merged), tokens), expected, atol=1e-5)
    assert not torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(base), tokens), expected, atol=1e-3)


def test_merge_without_format_hf_is_one_line(runs, tmp_path):
    result = ddptrain_cli("export", str(runs / "ddp"), "--merge", "--out", str(tmp_path / "m.safetensors"))
    assert result.returncode == 2 and result.stderr.strip() == (
        "ddptrain: error: --merge merges a LoRA adapter into its base model for --format hf; add --format hf")
