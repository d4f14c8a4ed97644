"""``--run-dir s3://...`` against a real S3-protocol server on loopback (moto's server mode):
runs killed for real and resumed from the store on "another machine" (an empty local mirror),
uploads cut before their manifest, bad credentials and buckets."""

import io
import json
import time

import pytest
import torch

from ddptrain import ConfigError, TrainingFailed, free_port
from helpers.commands import BIN, assert_same_weights, clean_env, ddptrain_cli, finish, fit, load_model
from helpers.proxy import TcpProxy

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
    kill = {"KILL_RANK": "1", "KILL_STEP": "42", "KILL_MARKER": str(tmp_path / "killed"), "KILL_ONCE_STORED": url}
    with pytest.raises(TrainingFailed):
        fit(TASKS + "kill_at_step", url, env=_machine(s3_server, tmp_path, "machine-1", **kill), **ARGS)
    fit(TASKS + "kill_at_step", url, env=_machine(s3_server, tmp_path, "machine-2", **kill), **ARGS)
    out, err = capfd.readouterr()
    assert "resumed from" in out, out + err
    assert_same_weights(_remote_model(s3_server, "ddp/team/run-1"), load_model(local_runs / "ddp"), exact=True)

    fs = s3_server.filesystem()
    names = {path.rsplit("/", 1)[-1] for path in fs.ls("ddp/team/run-1")}
    assert {"config.json", "metrics.jsonl", "model.pt", "snapshots"} <= names and ".hold" not in names
    records = [json.loads(line) for line in fs.cat_file("ddp/team/run-1/metrics.jsonl").decode().splitlines()]
    kept = sorted([("step", s) for s in range(10, 91, 10)] + [("epoch", 32), ("epoch", 64), ("epoch", 96)],
                  key=lambda kind_step: kind_step[1])  # --log-every's default, 10: each step record once too
    assert [(r["kind"], r["step"]) for r in records] == [*kept, ("goodput", 96)]
    timeline = [json.loads(line) for line in fs.cat_file("ddp/team/run-1/timeline.jsonl").decode().splitlines()]
    starts = [e["resumed_from"] for e in timeline if e["e"] == "start"]
    assert len(starts) == 2 and starts[0] == 0 < starts[1], starts  # one timeline, across the machines
    snapshots = sorted(path.rsplit("/", 1)[-1] for path in fs.ls("ddp/team/run-1/snapshots"))
    assert snapshots == KEPT
    for name in ("step-000000095", "step-000000096"):  # the manifest names the ranks' parts
        manifest = json.loads(fs.cat_file(f"ddp/team/run-1/snapshots/{name}.pt.manifest"))
        assert sorted(manifest["files"]) == ["", "ranks/rank-00000-of-00002.pt", "ranks/rank-00001-of-00002.pt"]


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
    kill = {"KILL_RANK": "1", "KILL_STEP": "27", "KILL_MARKER": str(tmp_path / "killed"), "KILL_ONCE_STORED": url}
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


def test_a_start_against_a_store_that_accepts_and_never_answers_is_one_line_within_30_s(s3_server, tmp_path):
    """A silent endpoint (the proxy accepts connections and drops every byte) used to print nothing
    and never exit; a dead one was already one line in seconds."""
    proxy = TcpProxy(s3_server.port).start()
    proxy.silence()
    started = time.monotonic()
    try:
        result = ddptrain_cli("train", "--run-dir", s3_server.bucket("silent-start") + "/run",
                              env=clean_env(**_machine(s3_server, tmp_path, "machine", AWS_ENDPOINT_URL=proxy.url)),
                              timeout=60)
    finally:
        proxy.close()
    took = time.monotonic() - started
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("ddptrain: error: --run-dir s3://silent-start/run: "), result.stderr
    assert took < 30, f"{took:.1f} s"


def test_a_run_dir_on_a_store_is_held_by_one_job_at_a_time(s3_server, tmp_path, monkeypatch):
    from ddptrain.resilience.hold import RemoteHold, RunDirHold
    from ddptrain.run_dir import StoreRunDir

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(RemoteHold, "SETTLE_S", 0.1)
    url = s3_server.bucket("held") + "/run"
    homes = []
    for machine in ("machine-1", "machine-2"):  # each machine's mirror under its own cache
        monkeypatch.setenv("DDPTRAIN_CACHE", str(tmp_path / machine))
        homes.append(StoreRunDir(url))
        homes[-1].create()
    first = RunDirHold(homes[0], "job-a").acquire()
    second = RunDirHold(homes[1], "job-b")  # another machine's mirror
    with pytest.raises(ConfigError, match=rf"^run dir {url} is in use by job job-a \(host "):
        second.acquire()
    assert not (homes[1].local / ".hold").exists()  # a refused job leaves nothing behind
    first.release()
    second.acquire().release()
    assert not s3_server.filesystem().exists("held/run/.hold")


def test_a_file_only_the_store_holds_is_in_the_run_dir_for_a_machine_whose_mirror_lacks_it(s3_server, tmp_path,
                                                                                           monkeypatch):
    """(A fresh start keeps the timeline of an attempt killed before its first snapshot only when
    the run never finished: no model.pt, asked of the store as well as of this machine's mirror.)"""
    from ddptrain.run_dir import StoreRunDir

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DDPTRAIN_CACHE", str(tmp_path / "another-machine"))
    url = s3_server.bucket("holds") + "/run"
    home = StoreRunDir(url)
    home.create()
    s3_server.filesystem().pipe_file("holds/run/model.pt", b"weights")
    assert home.holds("model.pt") and not (home.local / "model.pt").exists()
    assert not home.holds("metrics.jsonl")


def test_report_and_export_read_a_run_on_the_store_as_its_mirror(s3_server, tmp_path, monkeypatch, capsys):
    from ddptrain.cli import main
    from ddptrain.run_dir import RunDir

    for key, value in _machine(s3_server, tmp_path, "machine").items():
        monkeypatch.setenv(key, value)
    url = s3_server.bucket("read") + "/run"
    fit("regression", url, max_epochs=1)
    mirror = RunDir.of(url).local
    capsys.readouterr()
    assert main(["report", url]) == 0
    out = capsys.readouterr().out
    assert "train_loss" in out and f"ddptrain export {url} --format safetensors" in out, out
    assert main(["export", url, "--format", "torch", "--out", str(tmp_path / "remote.pt")]) == 0
    assert main(["export", str(mirror), "--format", "torch", "--out", str(tmp_path / "mirror.pt")]) == 0
    assert f"ddptrain export: {url} (model.pt)" in capsys.readouterr().out
    assert_same_weights(torch.load(tmp_path / "remote.pt", weights_only=True),
                        torch.load(tmp_path / "mirror.pt", weights_only=True), exact=True)

    # goodput's last timeline line, written after the end's last upload: the mirror keeps it
    # through the next start, and --sync store sends it
    def stored_timeline() -> str:
        return s3_server.filesystem().cat_file(url.removeprefix("s3://") + "/timeline.jsonl").decode()

    ours = (mirror / "timeline.jsonl").read_text()
    last = ours.rstrip().splitlines()[-2:]  # (the end's waits, then the launcher's exit once its ranks are gone)
    assert last[0].startswith('{"e":"closed"') and last[1].startswith('{"e":"exit"'), last
    assert ours.startswith(stored_timeline())
    fit("regression", url, max_epochs=1)  # the same command again: already finished, the store's files pulled
    assert (mirror / "timeline.jsonl").read_text() == ours
    assert main(["report", url, "--sync", "store"]) == 0
    assert stored_timeline() == ours


# --- the store goes away: a proxy in front of the server is cut, the server and its data stay -----
OUTAGE_TRAIN = ["train", "--task", TASKS + "slow_steps", "--nproc", "2", "--max-epochs", "3", "--save-every", "5",
                "--momentum", "0.9"]


def _start_cut_run(s3_server, proxy, tmp_path, start, url, outage=None, **more):
    """``ddptrain train`` through ``proxy``, cut (or ``outage()``) as soon as the store holds a committed snapshot."""
    env = clean_env(**_machine(s3_server, tmp_path, "machine", AWS_ENDPOINT_URL=proxy.url, **more))
    process = start([str(BIN / "ddptrain"), *OUTAGE_TRAIN, "--run-dir", url], env=env)
    fs, prefix = s3_server.filesystem(), url.removeprefix("s3://")
    deadline = time.monotonic() + 120
    while not fs.glob(f"{prefix}/snapshots/*.manifest"):
        if process.poll() is not None or time.monotonic() > deadline:  # ended, or no snapshot in time
            out, err, _ = finish(process, timeout=0)  # (kills what is still running)
            raise AssertionError(f"no committed snapshot while the run went on\n{out}\n{err}")
        time.sleep(0.05)
    (outage or proxy.cut)()
    return process, env


def _stored_weights(s3_server, prefix):
    fs = s3_server.filesystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{prefix}/snapshots"))
    newest_file = [name for name in names if name.endswith(".pt")][-1]
    newest = torch.load(io.BytesIO(fs.cat_file(f"{prefix}/snapshots/{newest_file}")), weights_only=True)
    return names, newest


# --keep 2: each snapshot file, its manifest, and its 2 ranks' parts' folder (snapshots/rank_parts.py)
KEPT = ["step-000000095.pt", "step-000000095.pt.manifest", "step-000000095.ranks",
        "step-000000096.pt", "step-000000096.pt.manifest", "step-000000096.ranks"]


def test_the_store_cut_for_30_s_mid_run_costs_nothing(s3_server, tmp_path, local_runs, start):
    proxy = TcpProxy(s3_server.port).start()
    url = s3_server.bucket("outage") + "/run"
    process, _ = _start_cut_run(s3_server, proxy, tmp_path, start, url, STEP_SLEEP="0.5")
    time.sleep(30)
    assert process.poll() is None, "the training went on through the outage"
    proxy.restore()
    out, err = process.communicate(timeout=180)
    proxy.close()
    assert process.returncode == 0, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("ddptrain:")]
    assert len(lines) == 2, err
    assert lines[0].startswith(f"ddptrain: warning: the store {url} does not answer (")
    assert lines[1].startswith(f"ddptrain: the store {url} answers again after "), lines
    assert "; caught up: " in lines[1]

    local = local_runs / "ddp"
    assert_same_weights(_remote_model(s3_server, "outage/run"), load_model(local), exact=True)
    names, newest = _stored_weights(s3_server, "outage/run")
    assert names == KEPT  # everything taken during the outage, rotated
    reference = torch.load(local / "snapshots" / "step-000000096.pt", weights_only=True)
    for part in ("model", "optimizer"):
        assert_same_weights(dict(_flat(newest[part])), dict(_flat(reference[part])), exact=True)
    assert not list(tmp_path.glob("machine/runs/s3/*/.not-uploaded.json"))
    assert sorted(p.name for p in tmp_path.glob("machine/runs/s3/*/snapshots/*")) == [
        "step-000000095.pt", "step-000000095.ranks", "step-000000096.pt", "step-000000096.ranks"
    ]  # the mirror rotated once the store held them


SILENCE_S, END_WAIT_S = 55, 45


def test_a_store_silent_from_mid_run_into_the_end_is_one_warning_and_the_end_catches_up(
        s3_server, tmp_path, local_runs, start):
    """A partition that drops packets: every connection stays open and nothing answers, for 55 s,
    from the first snapshot on. One warning within 20 s of the silence (a request with no answer
    is abandoned, not waited on for botocore's 60 s times every retry); the training goes on and
    ends during the silence (about 88 steps of 0.35 s: 31-40 s); the end's wait (45 s here, with
    DDPTRAIN_UPLOAD_WAIT_S) is still on when the store answers again, and the uploads catch up
    within 20 s of its return (they once took 44 s, and a short job whose store came back during
    its end failed); exit 0; the bucket's model.pt and newest snapshot are bitwise the local run's.
    (Until version 0.5: a 90 s silence, steps of 0.7 s and the default 60 s wait; the same
    order of events in 40 s less.)"""
    import threading

    proxy = TcpProxy(s3_server.port).start()
    url = s3_server.bucket("silent") + "/run"
    process, _ = _start_cut_run(s3_server, proxy, tmp_path, start, url, outage=proxy.silence, STEP_SLEEP="0.35",
                                DDPTRAIN_UPLOAD_WAIT_S=str(END_WAIT_S))
    silent_at = time.monotonic()
    said: list[tuple[float, str]] = []  # stderr's lines with when they came
    reader = threading.Thread(target=lambda: said.extend((time.monotonic(), line) for line in process.stderr),
                              daemon=True)
    reader.start()
    time.sleep(SILENCE_S)
    assert process.poll() is None, "the run waits for the store at its end"
    proxy.restore()
    restored_at = time.monotonic()
    process.wait(timeout=180)
    reader.join(10)
    proxy.close()
    err = "".join(line for _, line in said)
    assert process.returncode == 0, err
    lines = [(when, line) for when, line in said if line.startswith("ddptrain:")]
    assert len(lines) == 3 and "Traceback" not in err, err
    (warned, warning), (ended, waiting), (back_at, back) = lines
    assert warning.startswith(f"ddptrain: warning: the store {url} does not answer ("), warning
    assert warned - silent_at < 20, f"the warning came {warned - silent_at:.1f} s after the silence"
    assert waiting.startswith(f"ddptrain: waiting up to {END_WAIT_S} s for the store {url}"), err
    assert ended < restored_at, err
    assert back.startswith(f"ddptrain: the store {url} answers again after ") and "; caught up: " in back, back
    assert back_at - restored_at < 20, f"caught up {back_at - restored_at:.1f} s after the store's return"
    local = local_runs / "ddp"
    assert_same_weights(_remote_model(s3_server, "silent/run"), load_model(local), exact=True)
    names, newest = _stored_weights(s3_server, "silent/run")
    assert names[-2:] == ["step-000000096.pt.manifest", "step-000000096.ranks"], names
    reference = torch.load(local / "snapshots" / "step-000000096.pt", weights_only=True)
    for part in ("model", "optimizer"):
        assert_same_weights(dict(_flat(newest[part])), dict(_flat(reference[part])), exact=True)


def _flat(state, prefix=""):
    """(name, tensor) of every tensor in a nested state (the optimizer's)."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _flat(value, f"{prefix}.{key}")
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from _flat(value, f"{prefix}.{index}")


def test_a_store_still_down_at_the_end_is_one_line_and_a_later_sync_uploads_everything(s3_server, tmp_path,
                                                                                          local_runs, start):
    proxy = TcpProxy(s3_server.port).start()
    url = s3_server.bucket("down") + "/run"
    process, env = _start_cut_run(s3_server, proxy, tmp_path, start, url, STEP_SLEEP="0.05",
                                  DDPTRAIN_UPLOAD_WAIT_S="3")
    out, err = process.communicate(timeout=180)
    assert process.returncode == 1, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("ddptrain:")]
    assert lines[0].startswith(f"ddptrain: warning: the store {url} does not answer ("), err
    assert lines[1].startswith(f"ddptrain: waiting up to 3 s for the store {url} ("), err
    assert lines[2].startswith(f"ddptrain: error: the store {url} did not take the run's last uploads within 3 s ")
    assert f"upload them with: ddptrain report {url} --sync store" in lines[2]
    assert len(lines) == 3, err

    [mirror] = tmp_path.glob("machine/runs/s3/*")
    assert (mirror / ".not-uploaded.json").is_file()
    assert_same_weights(load_model(mirror), load_model(local_runs / "ddp"), exact=True)  # safe in the mirror
    assert "step-000000096.pt" in [p.name for p in (mirror / "snapshots").iterdir()]
    assert not s3_server.filesystem().exists("down/run/model.pt")
    still_down = ddptrain_cli(*OUTAGE_TRAIN, "--run-dir", url, env=env)  # a start that cannot read: one line
    assert still_down.returncode == 2, still_down.stderr
    assert still_down.stderr.startswith(f"ddptrain: error: --run-dir {url}: cannot reach it ("), still_down.stderr
    assert len(still_down.stderr.strip().splitlines()) == 1
    assert (mirror / ".not-uploaded.json").is_file() and (mirror / "model.pt").is_file()  # nothing removed

    proxy.restore()
    again = ddptrain_cli(*OUTAGE_TRAIN, "--run-dir", url, env=env)  # the same command: the mirror's uploads first
    assert again.returncode == 0, again.stderr
    assert again.stderr.startswith("ddptrain: uploaded 12 file(s) an earlier run on this machine could not "), \
        again.stderr  # the newest 2 snapshots, their 2 ranks' parts and their manifests, model.pt, config.json,
    # metrics.jsonl, timeline.jsonl
    assert "already finished" in again.stdout, again.stdout
    synced = ddptrain_cli("report", url, "--sync", "store", env=env)
    proxy.close()
    assert synced.returncode == 0, synced.stderr
    assert synced.stdout.startswith(f"store: uploaded 4 file(s) the mirror held and {url} lacked"), \
        synced.stdout  # the run files (timeline.jsonl among them) and model.pt again (small): nothing is newer
    assert_same_weights(_remote_model(s3_server, "down/run"), load_model(local_runs / "ddp"), exact=True)
    names, _ = _stored_weights(s3_server, "down/run")
    assert names == KEPT
    assert not (mirror / ".not-uploaded.json").exists()
    records = [json.loads(r) for r in s3_server.filesystem().cat_file("down/run/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in records if r["kind"] != "step"] == [32, 64, 96, 96]  # (the last: the run's goodput)
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(10, 91, 10))


def test_fsdp_on_two_machines_uploads_each_machines_shards_from_its_own_mirror(s3_server, tmp_path, local_runs,
                                                                                start):
    """Two torchrun agents, each a "machine" with its own mirror: rank 0 uploads its folder, rank 1
    its shard file; each snapshot is committed once both are in the store."""
    url = s3_server.bucket("two-machines") + "/run"
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [start([str(BIN / "torchrun"), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-machines", "-m", "ddptrain", "train",
                     "--task", "digits", "--strategy", "fsdp", "--max-epochs", "2", "--save-every", "10",
                     "--run-dir", url], env=clean_env(**_machine(s3_server, tmp_path, f"machine-{node}")))
              for node in range(2)]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    assert_same_weights(_remote_model(s3_server, "two-machines/run"), load_model(local_runs / "fsdp"), exact=True)
    fs = s3_server.filesystem()
    committed = sorted(p.rsplit("/", 1)[-1] for p in fs.glob("two-machines/run/snapshots/*.manifest"))
    assert committed == ["step-000000040.manifest", "step-000000046.manifest"]
    for name in ("step-000000040", "step-000000046"):
        manifest = json.loads(fs.cat_file(f"two-machines/run/snapshots/{name}.manifest"))
        assert {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= set(manifest["files"])
    # machine 1 holds nothing of the snapshots once its shards are uploaded
    assert not [p for p in (tmp_path / "machine-1").rglob("*") if "snapshots" in str(p) and p.is_file()]


def test_ddp_on_two_machines_commits_each_snapshot_once_the_other_machine_s_part_is_stored(
        s3_server, tmp_path, local_runs, start):
    """Each rank's part of a snapshot (its random states: snapshots/rank_parts.py) is written on its
    own machine: rank 1's, on machine 1, goes up from there, and rank 0 commits each snapshot file
    once it is in the store; the run is bitwise the local one, and machine 1 keeps nothing."""
    url = s3_server.bucket("two-machines-ddp") + "/run"
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [start([str(BIN / "torchrun"), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-machines-ddp", "-m", "ddptrain", "train",
                     "--task", "regression", "--max-epochs", "3", "--save-every", "5", "--momentum", "0.9",
                     "--run-dir", url], env=clean_env(**_machine(s3_server, tmp_path, f"machine-{node}")))
              for node in range(2)]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    assert_same_weights(_remote_model(s3_server, "two-machines-ddp/run"), load_model(local_runs / "ddp"), exact=True)
    fs = s3_server.filesystem()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("two-machines-ddp/run/snapshots")) == KEPT
    for name in ("step-000000095", "step-000000096"):
        manifest = json.loads(fs.cat_file(f"two-machines-ddp/run/snapshots/{name}.pt.manifest"))
        assert sorted(manifest["files"]) == ["", "ranks/rank-00000-of-00002.pt", "ranks/rank-00001-of-00002.pt"]
    assert not [p for p in (tmp_path / "machine-1").rglob("*") if "snapshots" in str(p) and p.is_file()]


def test_a_warmup_stable_decay_run_on_a_store_keeps_its_snapshot_before_the_decay(s3_server, tmp_path, monkeypatch):
    """--decay-fraction on a store's run dir under --keep 1: the snapshot before the decay stays in
    the store and in the mirror beside the newest, as on a local disk (tests/integration/test_go_on.py)."""
    from ddptrain.run_dir import RunDir

    for key, value in _machine(s3_server, tmp_path, "machine").items():
        monkeypatch.setenv(key, value)
    url = s3_server.bucket("wsd") + "/run"
    fit("regression", url, max_steps=12, save_every=4, keep=1, lr_schedule="linear", decay_fraction=0.25)
    home = RunDir.of(url)
    assert home.committed() == ["step-000000009.pt", "step-000000012.pt"]
    assert sorted(p.name for p in (home.local / "snapshots").glob("*.pt")) == home.committed()
