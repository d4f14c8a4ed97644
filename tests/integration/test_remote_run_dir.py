"""``--run-dir s3://...`` against a real S3-protocol server on loopback (moto's server mode):
runs killed for real and resumed from the store on "another machine" (an empty local mirror),
uploads cut before their manifest, bad credentials and buckets."""

import io
import json

import pytest
import torch

from ddptrain import ConfigError, TrainingFailed
from helpers.commands import assert_same_weights, clean_env, ddptrain_cli, fit, load_model

pytestmark = pytest.mark.slow
TASKS = "ddptrain_test_tasks:"
ARGS = {"max_epochs": 3, "save_every": 5, "momentum": 0.9}


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """The same runs on a local disk, uninterrupted: regression under ddp, digits under fsdp."""
    base = tmp_path_factory.mktemp("local")
    fit("regression", base / "ddp", **ARGS)
    fit("digits", base / "fsdp", strategy="fsdp", max_epochs=2, save_every=10)
    return base


def _machine(server, tmp_path, name, **more):
    """The environment of one machine: the store's endpoint and credentials, its own local mirror."""
    return {**server.env, "DDPTRAIN_CACHE": str(tmp_path / name), **more}


def _remote_model(server, path):
    return torch.load(io.BytesIO(server.filesystem().cat_file(f"{path}/model.pt")), weights_only=True)


def test_ddp_run_killed_and_resumed_on_another_machine_is_bitwise_the_local_run(s3_server, tmp_path, local_runs,
                                                                                 capfd):
    url = s3_server.bucket("ddp") + "/team/run-1"
    kill = {"KILL_RANK": "1", "KILL_STEP": "42", "KILL_MARKER": str(tmp_path / "killed")}
    with pytest.raises(TrainingFailed):
        fit(TASKS + "kill_at_step", url, env=_machine(s3_server, tmp_path, "machine-1", **kill), **ARGS)
    fit(TASKS + "kill_at_step", url, env=_machine(s3_server, tmp_path, "machine-2", **kill), **ARGS)
    assert "resumed from" in capfd.readouterr().out
    assert_same_weights(_remote_model(s3_server, "ddp/team/run-1"), load_model(local_runs / "ddp"), exact=True)

    fs = s3_server.filesystem()
    names = {path.rsplit("/", 1)[-1] for path in fs.ls("ddp/team/run-1")}
    assert {"config.json", "metrics.jsonl", "model.pt", "snapshots"} <= names and ".hold" not in names
    records = [json.loads(line) for line in fs.cat_file("ddp/team/run-1/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in records] == [32, 64, 96]
    snapshots = sorted(path.rsplit("/", 1)[-1] for path in fs.ls("ddp/team/run-1/snapshots"))
    assert snapshots == ["step-000000095.pt", "step-000000095.pt.manifest", "step-000000096.pt",
                         "step-000000096.pt.manifest"]  # --keep 2, each with its manifest


def test_a_snapshot_cut_before_its_manifest_is_never_loaded(s3_server, tmp_path, local_runs, capfd):
    url = s3_server.bucket("cut") + "/run"
    cut = {"CUT_COMMIT": "3", "MARKER": str(tmp_path / "cut")}  # the snapshot of step 15
    with pytest.raises(TrainingFailed):
        fit("storage_tasks:cut_before_manifest", url, env=_machine(s3_server, tmp_path, "m1", **cut), **ARGS)
    assert (tmp_path / "cut").read_text() == "step-000000015.pt"
    fit("storage_tasks:cut_before_manifest", url, env=_machine(s3_server, tmp_path, "m2", **cut), **ARGS)
    out, err = capfd.readouterr()
    assert (f"ddptrain: snapshot {url}/snapshots/step-000000015.pt was never committed (no manifest: its upload "
            "was cut short); removed it") in err
    assert "resumed from" in out and "step-000000010.pt" in out
    assert_same_weights(_remote_model(s3_server, "cut/run"), load_model(local_runs / "ddp"),
                        exact=True)


def test_fsdp_run_writes_dcp_to_the_store_and_resumes_bitwise(s3_server, tmp_path, local_runs):
    url = s3_server.bucket("fsdp") + "/run"
    kill = {"KILL_RANK": "1", "KILL_STEP": "27", "KILL_MARKER": str(tmp_path / "killed")}
    options = {"strategy": "fsdp", "max_epochs": 2, "save_every": 10}
    with pytest.raises(TrainingFailed):
        fit(TASKS + "kill_digits", url, env=_machine(s3_server, tmp_path, "m1", **kill), **options)
    fit(TASKS + "kill_digits", url, env=_machine(s3_server, tmp_path, "m2", **kill), **options)
    assert_same_weights(_remote_model(s3_server, "fsdp/run"), load_model(local_runs / "fsdp"), exact=True)
    fs = s3_server.filesystem()
    folder = sorted(fs.ls("fsdp/run/snapshots/step-000000046"))
    assert {p.rsplit("/", 1)[-1] for p in folder} >= {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"}
    assert fs.exists("fsdp/run/snapshots/step-000000046.manifest")


def test_a_store_without_credentials_or_bucket_is_a_one_line_error(s3_server, tmp_path):
    missing = ddptrain_cli("train", "--run-dir", "s3://no-such-bucket/run", env=clean_env(**s3_server.env))
    assert missing.returncode == 2
    assert missing.stderr.strip() == ("ddptrain: error: --run-dir s3://no-such-bucket/run: bucket 'no-such-bucket' "
                                      "does not exist (or this endpoint does not have it); create it or give "
                                      "another --run-dir")
    s3_server.bucket("creds")
    anonymous = {k: v for k, v in clean_env(**s3_server.env).items() if not k.startswith("AWS_") or k in (
        "AWS_ENDPOINT_URL", "AWS_EC2_METADATA_DISABLED")}
    anonymous["AWS_SHARED_CREDENTIALS_FILE"] = anonymous["AWS_CONFIG_FILE"] = str(tmp_path / "none")
    denied = ddptrain_cli("train", "--run-dir", "s3://creds/run", env=anonymous)
    assert denied.returncode == 2, denied.stderr
    assert len(denied.stderr.strip().splitlines()) == 1
    assert denied.stderr.startswith("ddptrain: error: --run-dir s3://creds/run: no access (NoCredentialsError")


def test_a_run_dir_on_a_store_is_held_by_one_job_at_a_time(s3_server, tmp_path, monkeypatch):
    from ddptrain.resilience.hold import RemoteHold, RunDirHold
    from ddptrain.storage import RemoteDir

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(RemoteHold, "SETTLE_S", 0.1)
    url = s3_server.bucket("held") + "/run"
    for machine in ("machine-1", "machine-2"):
        (tmp_path / machine).mkdir()
    first = RunDirHold(tmp_path / "machine-1", "job-a", RemoteDir(url)).acquire()
    second = RunDirHold(tmp_path / "machine-2", "job-b", RemoteDir(url))  # another machine's mirror
    with pytest.raises(ConfigError, match=rf"^run dir {url} is in use by job job-a \(host "):
        second.acquire()
    assert not (tmp_path / "machine-2" / ".hold").exists()  # a refused job leaves nothing behind
    first.release()
    second.acquire().release()
    assert not s3_server.filesystem().exists("held/run/.hold")


def test_report_and_export_read_a_run_on_the_store_as_its_mirror(s3_server, tmp_path, monkeypatch, capsys):
    from ddptrain.cli import main
    from ddptrain.storage import local_dir

    for key, value in _machine(s3_server, tmp_path, "machine").items():
        monkeypatch.setenv(key, value)
    url = s3_server.bucket("read") + "/run"
    fit("regression", url, max_epochs=1)
    mirror = local_dir(url)
    capsys.readouterr()
    assert main(["report", url]) == 0
    out = capsys.readouterr().out
    assert "train_loss" in out and f"ddptrain export {url} --format safetensors" in out, out
    assert main(["export", url, "--format", "torch", "--out", str(tmp_path / "remote.pt")]) == 0
    assert main(["export", str(mirror), "--format", "torch", "--out", str(tmp_path / "mirror.pt")]) == 0
    assert f"ddptrain export: {url} (model.pt)" in capsys.readouterr().out
    assert_same_weights(torch.load(tmp_path / "remote.pt", weights_only=True),
                        torch.load(tmp_path / "mirror.pt", weights_only=True), exact=True)
