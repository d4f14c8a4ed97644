"""Every documented command still works.

Fenced blocks in README.md and docs/*.md whose info string is ``sh run`` are run, each
block as one bash script that stops at the first failing line, in a scratch folder holding
a copy of examples/ and benchmarks/ (CPU, OMP_NUM_THREADS=1; the documented sizes are
already small). Blocks marked ``sh gpu`` or ``sh cluster`` cannot run
here: their ddptrain arguments must parse, `ddptrain <command> --help` must succeed, and
scripts they name must exist and pass `bash -n`.
"""

import re
import shlex
import shutil
import subprocess

import pytest

from ddptrain.cli import build_parser

from conftest import BIN, REPO, clean_env, run

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S+)(?: ([\w ]+))?\n(.*?)^```", re.S | re.M)


def blocks(kind: str) -> list[tuple[str, str]]:
    """(document, block text) for every ``sh <kind>`` block, continuation lines joined."""
    return [(doc.name, re.sub(r"\\\n\s*", " ", body))
            for doc in DOCS for lang, marks, body in FENCE.findall(doc.read_text())
            if lang == "sh" and kind in (marks or "").split()]


def commands(kind: str) -> list[tuple[str, str]]:
    return [(doc, line.strip()) for doc, body in blocks(kind) for line in body.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_docs_mark_commands():
    assert len(blocks("run")) >= 10 and commands("cluster") and commands("gpu")


@pytest.mark.slow
@pytest.mark.parametrize("doc,command", blocks("run"), ids=lambda v: v.splitlines()[0][:60] if "\n" in v else v)
def test_runnable_block(doc, command, tmp_path):
    for folder in ("examples", "benchmarks"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    env = clean_env()
    env["PATH"] = f"{BIN}:{env['PATH']}"
    result = run(["bash", "-e", "-c", command], env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, f"{doc}: `{command}` exited {result.returncode}\n{result.stdout}\n{result.stderr}"


def _ddptrain_args(words: list[str]) -> list[str] | None:
    for i, word in enumerate(words):
        if word.endswith("ddptrain") and i + 1 < len(words) and words[i + 1] in ("train", "env", "report", "bench"):
            return words[i + 1:]
    return None


@pytest.mark.parametrize("doc,command", commands("gpu") + commands("cluster"),
                         ids=lambda v: v if "/" not in v else None)
def test_gpu_and_cluster_commands_parse(doc, command):
    words = shlex.split(command)
    for word in words:
        if word.endswith((".sbatch", ".sh")):
            assert (REPO / word).is_file(), f"{doc}: {word} does not exist"
            assert subprocess.run(["bash", "-n", str(REPO / word)]).returncode == 0
    args = _ddptrain_args(words)
    if args is None:
        return
    sub = args[0]
    if sub == "train":
        parsed, unknown = build_parser().parse_known_args(args)
        assert not unknown, f"{doc}: `{command}`: ddptrain does not know {unknown}"
    assert run([str(BIN / "ddptrain"), sub, "--help"]).returncode == 0
