"""uploads.Uploader against a real S3 server (moto) behind a proxy the test cuts: the order and
coalescing of uploads, the mirror's rotation sparing what the store lacks, the two lines of an
outage, the ledger, and the end's one line when the store is still down."""

import json

import pytest
import torch

from ddptrain.errors import StoreBehind
from ddptrain.run_dir import LEDGER, StoreRunDir
from ddptrain.snapshots import files
from ddptrain.snapshots.uploads import Uploader, sync_up
from helpers.proxy import TcpProxy

pytestmark = pytest.mark.slow


@pytest.fixture
def through_proxy(s3_server, monkeypatch):
    """(the store's URL, the proxy, a client of the server itself): the uploads go through the proxy."""
    proxy = TcpProxy(s3_server.port).start()
    for key, value in {**s3_server.env, "AWS_ENDPOINT_URL": proxy.url}.items():
        monkeypatch.setenv(key, value)
    yield proxy
    proxy.close()


def _snapshot(mirror, uploader, step):
    state = {"progress": {"global_step": step}, "model": {"w": torch.full((4,), float(step))}}
    path = files.write_snapshot(state, mirror / "snapshots", keep=1, spare=uploader.pending_snapshots())
    uploader.add_snapshot(path.name)


def _wait_for(condition, seconds=20.0):
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_an_outage_costs_two_lines_and_the_store_ends_as_the_mirror(s3_server, through_proxy, tmp_path, capsys,
                                                                    monkeypatch):
    url = s3_server.bucket("uploads-outage") + "/run"
    monkeypatch.setenv("DDPTRAIN_CACHE", str(tmp_path))  # the run dir's mirror
    mirror = StoreRunDir(url).local
    mirror.mkdir(parents=True)
    uploader = Uploader(StoreRunDir(url), keep=1)
    (mirror / "metrics.jsonl").write_text("one\n")
    uploader.add_file("metrics.jsonl")
    _snapshot(mirror, uploader, 5)
    _wait_for(lambda: not uploader.queue)

    through_proxy.cut()
    for step in (10, 15, 20):
        _snapshot(mirror, uploader, step)
        (mirror / "metrics.jsonl").write_text(f"up to {step}\n")
        uploader.add_file("metrics.jsonl")  # queued once, whatever its number of writes
    _wait_for(lambda: (mirror / LEDGER).is_file())
    assert sorted(p.name for p in (mirror / "snapshots").iterdir()) == [  # --keep 1, but not in the store yet
        "step-000000010.pt", "step-000000015.pt", "step-000000020.pt"]
    assert list(uploader.queue) == ["snapshots/step-000000010.pt", "metrics.jsonl", "snapshots/step-000000015.pt",
                                    "snapshots/step-000000020.pt"]
    assert json.loads((mirror / LEDGER).read_text())["store"] == url

    through_proxy.restore()
    uploader.close(wait_s=60)  # the backoff's longest pause is within it; once it returns the process may end:
    # the line that says the store caught up, and the mirror's rotation, came before (the line was once cut off)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3, err
    assert err[0].startswith(f"ddptrain: warning: the store {url} does not answer (")
    assert err[1].startswith(f"ddptrain: waiting up to 60 s for the store {url} (")  # (the end began with it down)
    assert err[2].startswith(f"ddptrain: the store {url} answers again after ")
    assert err[2].endswith("caught up: 7 file(s) uploaded")  # 3 snapshots, their manifests, metrics.jsonl
    fs = s3_server.filesystem()
    assert fs.cat_file("uploads-outage/run/metrics.jsonl") == b"up to 20\n"
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("uploads-outage/run/snapshots")) == [
        "step-000000020.pt", "step-000000020.pt.manifest"]  # --keep 1, the older ones rotated away
    assert [p.name for p in (mirror / "snapshots").iterdir()] == ["step-000000020.pt"]
    assert not (mirror / LEDGER).exists()


def test_a_store_down_at_the_end_is_one_error_and_sync_up_uploads_it_later(s3_server, through_proxy, tmp_path,
                                                                           capsys, monkeypatch):
    url = s3_server.bucket("uploads-down") + "/run"
    monkeypatch.setenv("DDPTRAIN_CACHE", str(tmp_path))  # the run dir's mirror
    mirror = StoreRunDir(url).local
    mirror.mkdir(parents=True)
    remote = StoreRunDir(url)
    uploader = Uploader(remote, keep=2)
    through_proxy.cut()
    _snapshot(mirror, uploader, 7)
    torch.save({"w": torch.ones(2)}, mirror / "model.pt")
    uploader.add_file("model.pt")
    with pytest.raises(StoreBehind) as behind:
        uploader.close(wait_s=2)
    message = str(behind.value)
    assert message.startswith(f"the store {url} did not take the run's last uploads within 2 s (")  # (why)
    assert "not uploaded: snapshots/step-000000007.pt, model.pt; they are safe in " in message
    assert message.endswith(f"upload them with: ddptrain report {url} --sync store (or run the same train command)")
    assert "\n" not in message
    assert json.loads((mirror / LEDGER).read_text())["not_uploaded"] == ["snapshots/step-000000007.pt", "model.pt"]

    (mirror / "best").mkdir()  # --keep-best's, written while the store was down
    torch.save({"w": torch.zeros(2)}, mirror / "best" / "model.pt")
    (mirror / "best" / "best.json").write_text('{"step": 7}\n')
    # A request in flight when close() gave up may still land once the store answers (the
    # ledger's sync checks the store first); here the process lives on, so its thread must end
    # (its request failing against the cut store) before the store comes back, or the count races.
    uploader.thread.join(timeout=60)
    assert not uploader.thread.is_alive()
    through_proxy.restore()
    assert sync_up(StoreRunDir(url), keep=2) == 5  # the snapshot, its manifest, model.pt, best/'s two
    fs = s3_server.filesystem()
    assert fs.exists("uploads-down/run/snapshots/step-000000007.pt.manifest")
    assert torch.equal(torch.load(mirror / "model.pt")["w"], torch.ones(2))
    assert fs.cat_file("uploads-down/run/model.pt") == (mirror / "model.pt").read_bytes()
    assert fs.cat_file("uploads-down/run/best/best.json") == b'{"step": 7}\n'
    assert not (mirror / LEDGER).exists()
    assert sync_up(StoreRunDir(url), keep=2) == 3  # model.pt and best/ again; no snapshot newer than the store


def test_a_store_that_hangs_holds_the_end_no_longer_than_its_bound(s3_server, through_proxy, tmp_path, monkeypatch):
    """Connections accepted, never answered: the end still comes after the wait, and the hold's
    release after RELEASE_WAIT_S."""
    import time

    from ddptrain.resilience.hold import RELEASE_WAIT_S, RemoteHold

    url = s3_server.bucket("uploads-hung") + "/run"
    monkeypatch.setenv("DDPTRAIN_CACHE", str(tmp_path))  # the run dir's mirror
    mirror = StoreRunDir(url).local
    mirror.mkdir(parents=True)
    through_proxy.hang()
    uploader = Uploader(StoreRunDir(url), keep=2)
    (mirror / "metrics.jsonl").write_text("one\n")
    uploader.add_file("metrics.jsonl")
    started = time.monotonic()
    with pytest.raises(StoreBehind, match=r"within 2 s \(its requests had not returned\): not uploaded: metrics"):
        uploader.close(wait_s=2)
    RemoteHold(StoreRunDir(url), "job-a").release(quiet=True)
    assert time.monotonic() - started < 2 + RELEASE_WAIT_S + 2
