"""CPU ranks allocate with mimalloc: ``ddptrain train`` re-executes itself once with it preloaded.

Why: CPU tensors come from the C allocator. glibc's raises its mmap threshold after the first
large free, so the blocks that ``--strategy fsdp`` gathers and frees every step stay in its heap
and fragment it: on the 34M-parameter MLP (2 ranks, AdamW) a rank peaked at 1.15-1.33 GB, more
than ddp's 0.85-0.90 GB, although it holds half the model state. Fixing glibc's threshold gives
the memory back (0.56 GB) at half the speed: every large buffer then gets fresh, zeroed pages.
mimalloc reuses freed blocks by size class and decommits what stays free (eager commit off,
purges decommit): the same fsdp rank peaked at 0.59 GB at glibc's speed (benchmarks/fsdp_memory.py;
README: FSDP). ddp runs at the same speed or faster under it.

An allocator is chosen when a process starts (``LD_PRELOAD``), so the command re-executes itself
before importing torch: the same process id, arguments and file descriptors, which torchrun and
srun, watching that process, never see change. Local CPU ranks are forked from it and keep it.
Not applied: on a machine with NVIDIA devices (the GPU allocator holds what matters there),
inside ``fit()`` (the caller's process is not ours to restart; its ranks use its allocator),
where the wheel is missing, or with ``DDPTRAIN_ALLOCATOR=system``.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping
from pathlib import Path

CHOICE = "DDPTRAIN_ALLOCATOR"  # "mimalloc" (the default on CPU machines) or "system"
# mimalloc's own settings, unless the user set them: commit arena memory when used and give
# purged pages back to the OS, so a rank's resident memory follows what it holds.
MIMALLOC_SETTINGS = {"MIMALLOC_ARENA_EAGER_COMMIT": "0", "MIMALLOC_PURGE_DECOMMITS": "1"}
LIBRARY = "cmeel.prefix/lib/libmimalloc.so"


def mimalloc_path() -> Path | None:
    """The shared library of the cmeel-mimalloc wheel, a dependency of ddptrain on Linux: where
    this interpreter installs wheels, else wherever the wheel's metadata says (a slower search
    of every installed package's metadata: 27 ms here)."""
    import sysconfig

    for scheme in ("purelib", "platlib"):
        beside = Path(sysconfig.get_paths()[scheme]) / LIBRARY
        if beside.exists():
            return beside
    from importlib import metadata  # (29 ms to import, here)

    try:
        path = Path(str(metadata.distribution("cmeel-mimalloc").locate_file(LIBRARY)))
    except metadata.PackageNotFoundError:
        return None
    return path if path.exists() else None


def has_nvidia_devices() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def wants_mimalloc(argv: list[str], env: Mapping[str, str]) -> bool:
    """Whether this ``ddptrain`` command should run its ranks under mimalloc (and is not yet)."""
    if sys.platform != "linux" or not argv or argv[0] != "train":
        return False
    if env.get(CHOICE, "mimalloc") == "system" or "libmimalloc" in env.get("LD_PRELOAD", ""):
        return False
    if any(arg in ("--device=cuda", "--backend=nccl") for arg in argv) or _flag_value(argv, "--device") == "cuda":
        return False
    return not has_nvidia_devices()


def _flag_value(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def preloaded_env(env: Mapping[str, str], library: Path) -> dict[str, str]:
    """The environment to re-execute with: mimalloc first in LD_PRELOAD, its settings defaulted."""
    preload = " ".join(filter(None, [str(library), env.get("LD_PRELOAD", "")]))
    return {**MIMALLOC_SETTINGS, **env, "LD_PRELOAD": preload, CHOICE: "mimalloc"}


def reexec_with_mimalloc(argv: list[str]) -> None:
    """Replace this process with itself under mimalloc when ``wants_mimalloc``; else return."""
    if not wants_mimalloc(argv, os.environ):
        return
    library = mimalloc_path()
    if library is None:
        return
    env = preloaded_env(os.environ, library)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:  # cannot re-execute (a frozen or odd interpreter): train with what we have
        return


def forget_preload() -> None:
    """After start: this process has mimalloc; processes it *executes* (a tracker's service, a
    user's subprocess) should not inherit the preload. Forked children keep it either way."""
    if os.environ.get(CHOICE) == "mimalloc":
        preload = [p for p in os.environ.get("LD_PRELOAD", "").split() if "libmimalloc" not in p]
        if preload:
            os.environ["LD_PRELOAD"] = " ".join(preload)
        else:
            os.environ.pop("LD_PRELOAD", None)
