"""When `ddptrain train` re-executes itself under mimalloc (launch/allocator.py), in-process."""

import pytest

from ddptrain.launch import allocator
from ddptrain.launch.allocator import MIMALLOC_SETTINGS, mimalloc_path, preloaded_env, wants_mimalloc


@pytest.fixture
def cpu_machine(monkeypatch):
    monkeypatch.setattr(allocator, "has_nvidia_devices", lambda: False)


def test_train_on_a_cpu_machine_wants_it(cpu_machine):
    assert wants_mimalloc(["train", "--nproc", "2"], {})


@pytest.mark.parametrize("argv", [["report", "runs/x"], ["export", "runs/x"], ["env"], []])
def test_other_commands_do_not(cpu_machine, argv):
    assert not wants_mimalloc(argv, {})


@pytest.mark.parametrize("argv", [["train", "--device", "cuda"], ["train", "--device=cuda"],
                                  ["train", "--backend=nccl"]])
def test_a_gpu_run_does_not(cpu_machine, argv):
    assert not wants_mimalloc(argv, {})


def test_a_machine_with_nvidia_devices_does_not(monkeypatch):
    monkeypatch.setattr(allocator, "has_nvidia_devices", lambda: True)
    assert not wants_mimalloc(["train"], {})


def test_the_user_can_say_no_and_it_never_loops(cpu_machine):
    assert not wants_mimalloc(["train"], {"DDPTRAIN_ALLOCATOR": "system"})
    assert not wants_mimalloc(["train"], {"LD_PRELOAD": "/x/libmimalloc.so.3"})


def test_the_preload_goes_first_and_the_users_settings_win():
    env = preloaded_env({"LD_PRELOAD": "/lib/libfoo.so", "MIMALLOC_PURGE_DECOMMITS": "0"}, "/m/libmimalloc.so")
    assert env["LD_PRELOAD"] == "/m/libmimalloc.so /lib/libfoo.so"
    assert env["MIMALLOC_PURGE_DECOMMITS"] == "0"
    assert env["MIMALLOC_ARENA_EAGER_COMMIT"] == MIMALLOC_SETTINGS["MIMALLOC_ARENA_EAGER_COMMIT"]
    assert env["DDPTRAIN_ALLOCATOR"] == "mimalloc"


def test_the_wheel_is_installed_with_ddptrain():
    path = mimalloc_path()
    assert path is not None and path.name.startswith("libmimalloc")


def test_what_runs_before_the_re_execution_imports_next_to_nothing():
    """Everything imported before the re-execution is imported twice (1.22x the training floor
    once, 0.18 s of it the re-execution): the command's first lines import the allocator's module
    alone, not the settings (ddptrain/__init__ did: 45 ms) nor importlib.metadata (29 ms)."""
    import subprocess
    import sys

    probe = ("import sys, ddptrain.start, ddptrain.launch.allocator as a; a.mimalloc_path(); "
             "print(' '.join(sorted(sys.modules)))")
    printed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    loaded = set(printed.split())
    assert not {"ddptrain.settings", "ddptrain.cli", "importlib.metadata", "torch"} & loaded, sorted(loaded)
