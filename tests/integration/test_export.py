"""``ddptrain export``: a run's weights as safetensors, a Hugging Face folder, a torch state_dict;
from model.pt or any snapshot, an FSDP run's DCP folder included."""

import pytest
import torch
from safetensors.torch import load_file

from ddptrain.cli import main
from helpers.commands import BIN, assert_ok, assert_same_weights, ddptrain_cli, fit, load_model, read_metrics, run

TASKS = "ddptrain_test_tasks:"


@pytest.mark.slow
def test_an_fsdp_runs_model_and_its_dcp_snapshot_export_to_the_same_safetensors(tmp_path):
    fit("digits", tmp_path / "run", strategy="fsdp", max_epochs=2, save_every=10)  # keeps steps 40 and 46
    last = read_metrics(tmp_path / "run")[-1]["step"]
    assert (tmp_path / "run" / "snapshots" / f"step-{last:09d}").is_dir()  # a DCP folder
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "final.safetensors")]) == 0
    dcp = ["--snapshot", str(last), "--out", str(tmp_path / "dcp.safetensors")]
    assert main(["export", str(tmp_path / "run"), *dcp]) == 0
    assert main(["export", str(tmp_path / "run"), "--format", "torch", "--snapshot", "40",
                 "--out", str(tmp_path / "step-40.pt")]) == 0
    model = load_model(tmp_path / "run")
    assert_same_weights(load_file(tmp_path / "final.safetensors"), model, exact=True)
    assert_same_weights(load_file(tmp_path / "dcp.safetensors"), model, exact=True)
    early = torch.load(tmp_path / "step-40.pt", weights_only=True)
    assert early.keys() == model.keys() and not all(torch.equal(early[k], model[k]) for k in model)


@pytest.mark.slow
def test_export_of_no_run_or_a_missing_snapshot_is_one_line(tmp_path, capfd):
    (tmp_path / "empty").mkdir()
    fit("regression", tmp_path / "run", max_epochs=1, save_every=0)
    for args, words in [
        ([str(tmp_path / "empty")], "holds no ddptrain run (no config.json); give the --run-dir of a run"),
        ([str(tmp_path / "run"), "--snapshot", "7"], "has no snapshot of step 7; its snapshots are of steps: 32"),
        ([str(tmp_path / "run"), "--format", "hf"], "the task regression's model is a Linear, not a transformers "
                                                     "model; --format hf needs one"),
    ]:
        capfd.readouterr()
        assert main(["export", *args, "--out", str(tmp_path / "out")]) == 2
        err = capfd.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err, err

    (tmp_path / "taken.pt").write_bytes(b"theirs")
    (tmp_path / "a-file").write_text("")
    for out, words in [(tmp_path / "taken.pt", f"--out {tmp_path / 'taken.pt'} exists; pass --force to replace it"),
                       (tmp_path / "a-file" / "m.pt", f"--out {tmp_path / 'a-file' / 'm.pt'}: cannot create")]:
        capfd.readouterr()
        assert main(["export", str(tmp_path / "run"), "--format", "torch", "--out", str(out)]) == 2
        err = capfd.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err, err
    assert (tmp_path / "taken.pt").read_bytes() == b"theirs"  # refused: untouched
    assert main(["export", str(tmp_path / "run"), "--format", "torch", "--out", str(tmp_path / "taken.pt"),
                 "--force"]) == 0
    assert_same_weights(torch.load(tmp_path / "taken.pt", weights_only=True), load_model(tmp_path / "run"), exact=True)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing left aside


def test_safetensors_comes_with_ddptrain():
    """`ddptrain report` suggests `export --format safetensors`: the package it needs is a dependency."""
    from importlib.metadata import requires

    assert any(r.split(">")[0].split(";")[0].strip() == "safetensors" for r in requires("ddptrain") or [])


transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'ddptrain[hf]') is not installed")


@pytest.mark.slow
def test_gpt2_exports_to_a_hugging_face_folder_that_gives_the_trained_models_logits(tmp_path):
    fit(TASKS + "small_gpt2", tmp_path / "run", max_steps=6, batch_size=8)
    assert_ok(ddptrain_cli("export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    import ddptrain_test_tasks

    trained = ddptrain_test_tasks.small_gpt2(None).model
    trained.load_state_dict(load_model(tmp_path / "run"))
    tokens = torch.arange(64).remainder(256).reshape(1, 64)
    with torch.no_grad():
        assert torch.equal(exported(input_ids=tokens).logits, trained.eval()(input_ids=tokens).logits)
    result = run([str(BIN / "ddptrain"), "export", str(tmp_path / "run"), "--out", str(tmp_path / "m.safetensors")])
    assert_ok(result)
    assert_same_weights({k: v for k, v in load_file(tmp_path / "m.safetensors").items()},
                        load_model(tmp_path / "run"), exact=True)

    # The task's code and data gone: hf_model.json (the model's class and config) is all it needs.
    config = tmp_path / "run" / "config.json"
    config.write_text(config.read_text().replace(TASKS + "small_gpt2", "gone_module:task"))
    assert_ok(ddptrain_cli("export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf"),
                           "--force"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=tokens).logits, trained(input_ids=tokens).logits)
    (tmp_path / "run" / "hf_model.json").unlink()  # a run from before it: the task is needed, and named
    gone = ddptrain_cli("export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf2"))
    assert gone.returncode == 2 and len(gone.stderr.strip().splitlines()) == 1, gone.stderr
    assert "has no hf_model.json" in gone.stderr and "gone_module:task" in gone.stderr, gone.stderr
