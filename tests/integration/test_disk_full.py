"""A run dir whose disk fills up mid-run: a real, tiny tmpfs, a real `ddptrain train`."""

import shutil
import subprocess

import pytest

from ddptrain.snapshots import files
from helpers.commands import assert_ok, assert_same_weights, ddptrain_cli, load_model

FLAGS = ["--task", "digits", "--max-epochs", "2", "--save-every", "5", "--save-seconds", "0"]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (mounting one needs root, as on this project's machines and CI)."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_is_one_line_and_the_run_resumes_bitwise_once_space_is_freed(small_disk, tmp_path):
    assert_ok(ddptrain_cli("train", *FLAGS, "--run-dir", str(tmp_path / "straight")))
    snapshots = tmp_path / "straight" / "snapshots"
    snapshot = max(p.stat().st_size for p in snapshots.glob("step-*.pt"))
    parts = max(sum(part.stat().st_size for part in folder.iterdir()) for folder in snapshots.glob("step-*.ranks"))
    filler = small_disk / "filler"
    # Room for two snapshots (--keep 2), the three snapshots' parts (each rank's, written before the
    # file: snapshots/rank_parts.py) and the run's small files; not for the third file beside them.
    # (Where the parts were left out, the disk filled before the file, and the ranks' error reports
    # on it could not be written: torch's agent then failed reading an empty one, a traceback.)
    room = int(2.6 * snapshot) + 3 * parts + (96 << 10)
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - room))
    run_dir = small_disk / "run"

    full = ddptrain_cli("train", *FLAGS, "--run-dir", str(run_dir))
    lines = [line for line in full.stderr.splitlines() if line.strip()]
    assert full.returncode == 1, full.stderr
    assert len(lines) <= 3 and "Traceback" not in full.stderr, full.stderr
    assert f"no space left in {run_dir} writing step-" in full.stderr and "MB free" in full.stderr, full.stderr
    assert "is intact" in full.stderr and "run the same command to resume" in full.stderr, full.stderr
    left = files.list_snapshots(run_dir / "snapshots")
    assert len(left) == 2, left
    for path in left:
        files.load_snapshot(path)  # every snapshot left loads
    assert not [p for p in (run_dir / "snapshots").iterdir() if p.name.startswith(".")]  # no partial file

    filler.unlink()
    resumed = ddptrain_cli("train", *FLAGS, "--run-dir", str(run_dir))
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout
    assert_same_weights(load_model(run_dir), load_model(tmp_path / "straight"), exact=True)
