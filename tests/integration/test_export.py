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
