"""Every documented command still works, and prints what the docs say it prints.

Fenced blocks in README.md and docs/*.md whose info string is ``sh run`` are run, each block
as one bash script that stops at the first failing line, in a scratch folder holding a copy
of examples/ (CPU, OMP_NUM_THREADS=1). A ``text`` block right after a run block shows what it
prints: each of its lines must match an output line, in that order, column by column (word by
word: a column more or less fails), where ``…`` stands for one word, or part of one, that differs
from run to run (a rate, a time, a hash). One block runs alone by its id (the page and its number
there): ``pytest 'tests/integration/test_docs.py::test_runnable_block[guide-3]'`` runs only that
block (the ids: ``pytest tests/integration/test_docs.py --collect-only -q``). Blocks marked
``sh gpu`` or ``sh cluster`` cannot run here: their ddptrain arguments must parse,
`ddptrain <command> --help` must succeed, and scripts they name must exist and pass `bash -n`.
"""

import collections
import concurrent.futures
import contextlib
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddptrain.cli import build_parser
from helpers.commands import BIN, REPO, TESTS, ForkedCommand, clean_env, descendants, run

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S+)(?: ([\w ./=\"-]+))?\n(.*?)^```\n", re.S | re.M)


def blocks(kind: str) -> list[tuple[str, str, str | None]]:
    """(document, block text, the text block it prints or None) for every ``sh <kind>`` block."""
    found: list[tuple[str, str, str | None]] = []
    for doc in DOCS:
        text = doc.read_text()
        fences = list(FENCE.finditer(text))
        for fence, following in zip(fences, fences[1:] + [None]):
            lang, marks, body = fence.groups()
            if lang != "sh" or kind not in (marks or "").split():
                continue
            shows = None
            adjacent = following is not None and not text[fence.end():following.start()].strip()
            if adjacent and following.group(1) == "text":
                shows = following.group(3)
            found.append((doc.name, re.sub(r"\\\n\s*", " ", body), shows))
    return found


def commands(kind: str) -> list[tuple[str, str]]:
    return [(doc, line.strip()) for doc, body, _ in blocks(kind) for line in body.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_a_file_a_page_shows_is_that_file_as_it_is():
    """A ``python title="PATH"`` block shows PATH of the repository whole (the run blocks use the file)."""
    shown = [(doc.name, marks.split("=", 1)[1].strip('"'), body) for doc in DOCS for lang, marks, body in
             (fence.groups() for fence in FENCE.finditer(doc.read_text())) if (marks or "").startswith("title=")]
    assert {path for _, path, _ in shown} >= {"examples/nanogpt/nanogpt_task.py", "examples/nanogpt/sample.py"}
    for doc, path, body in shown:
        assert body == (REPO / path).read_text(), f"{doc} shows {path} other than it is"


def test_docs_mark_commands_and_show_their_output():
    assert len(blocks("run")) >= 10 and commands("cluster") and commands("gpu")
    assert sum(shows is not None for _, _, shows in blocks("run")) >= 6


def _pattern(line: str) -> re.Pattern[str]:
    """A shown line as a pattern: its words in order, each exact but where ``…`` stands for a part
    that varies (one or more characters, never a space: a column cannot hide behind it)."""
    words = [r"\S+?".join(re.escape(part) for part in word.split("…")) for word in line.split()]
    return re.compile(r"^\s*" + r"\s+".join(words) + r"\s*$")


def assert_shows(output: str, shown: str, where: str) -> None:
    """Each shown line matches an output line, in order (other output lines may come between)."""
    lines = output.splitlines()
    position = 0
    for expected in (line for line in shown.splitlines() if line.strip()):
        pattern = _pattern(expected)
        while position < len(lines) and not pattern.fullmatch(lines[position]):
            position += 1
        assert position < len(lines), f"{where}: the docs show\n  {expected}\nbut the command printed:\n{output}"
        position += 1


RUN_BLOCKS = blocks("run")


def block_ids() -> list[str]:
    """Each run block's id: its page and its number there (``guide-3``: guide.md's third)."""
    ids, seen = [], collections.Counter()
    for doc, _, _ in RUN_BLOCKS:
        page = Path(doc).stem
        seen[page] += 1
        ids.append(f"{page}-{seen[page]}")
    return ids


@pytest.fixture(scope="module")
def block_results(request, tmp_path_factory):
    """The output of every run block this session runs (all, or the one selected by its id), two
    blocks at a time (each in a scratch folder of its own, on ports the OS picks: they only share
    the CPUs, and nothing here measures time). A block's ``ddptrain`` is forked by the command
    server (helpers/served_command.py: the interpreter's start is the tests of the start's)."""
    chosen = sorted({item.callspec.params["index"] for item in request.session.items
                     if getattr(item, "originalname", "") == "test_runnable_block"})
    served = tmp_path_factory.mktemp("served-bin")
    client = TESTS / "helpers" / "served_command.py"
    (served / "ddptrain").write_text(f'#!/bin/sh\nexec {sys.executable} -I {client} "$@"\n')
    (served / "ddptrain").chmod(0o755)
    env = clean_env(DDPTRAIN_COMMAND_SERVER=ForkedCommand.server(), DDPTRAIN_COMMAND=str(BIN / "ddptrain"))
    env["PATH"] = f"{served}:{BIN}:{env['PATH']}"

    def execute(folder: Path, command: str) -> subprocess.CompletedProcess[str]:
        shutil.copytree(REPO / "examples", folder / "examples")
        (folder / ".served").mkdir()
        try:
            return run(["bash", "-e", "-c", f"exec 2>&1\n{command}"], env={**env, "DDPTRAIN_SERVED_PIDS":
                       str(folder / ".served")}, cwd=folder, timeout=300)
        finally:  # what the block's commands left running (a block that ran past its time)
            for pid in (int(p.name) for p in (folder / ".served").iterdir()):
                for left in (pid, *descendants(pid)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(left, signal.SIGKILL)

    # The scratch folders are made here, one thread: mktemp numbers its folders (and makes pytest's
    # base folder on first use) without a lock, and two threads once got the same one.
    folders = [tmp_path_factory.mktemp("block") for _ in chosen]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(chosen, pool.map(execute, folders, [RUN_BLOCKS[index][1] for index in chosen])))


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RUN_BLOCKS)), ids=block_ids())
def test_runnable_block(index, block_results):
    doc, command, shows = RUN_BLOCKS[index]
    result = block_results[index]
    assert result.returncode == 0, f"{doc}: `{command}` exited {result.returncode}\n{result.stdout}"
    if shows is not None:
        assert_shows(result.stdout, shows, doc)


SUBCOMMANDS = ("train", "env", "report", "bench", "lighthouse")


def _ddptrain_args(words: list[str]) -> list[str] | None:
    for i, word in enumerate(words):
        if word.endswith("ddptrain") and i + 1 < len(words) and words[i + 1] in SUBCOMMANDS:
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
    if args[0] in ("train", "lighthouse"):
        parsed, unknown = build_parser().parse_known_args(args)
        assert not unknown, f"{doc}: `{command}`: ddptrain does not know {unknown}"
    assert _help_works(args[0])


@functools.cache
def _help_works(subcommand: str) -> bool:
    return run([str(BIN / "ddptrain"), subcommand, "--help"]).returncode == 0


def test_shown_output_is_matched_line_by_line_in_order_and_column_by_column():
    output = "training x\nepoch 0 | 12,345 samples/s\nnoise\nsummary\nsaved to runs/a-1f3c/model.pt\n"
    assert_shows(output, "epoch 0 | … samples/s\nsummary\nsaved to runs/a-…/model.pt", "here")
    for shown in ("summary\nepoch 0 | … samples/s\n",  # the order matters
                  "epoch 0 | …",  # a column the docs do not show
                  "epoch 1 | … samples/s",  # what is shown, exactly
                  "epoch 0 | … samples/s | … s"):  # a column the output lacks
        with pytest.raises(AssertionError, match="the docs show"):
            assert_shows(output, shown, "here")
    assert_shows("epoch 0 | 9 samples/s | 12 tokens/s\n", "epoch 0 | … samples/s | … tokens/s", "here")
    with pytest.raises(AssertionError, match="the docs show"):  # a new column in the output fails the page
        assert_shows("epoch 0 | 9 samples/s | 12 tokens/s | 3 TFLOP/s\n", "epoch 0 | … samples/s | … tokens/s", "")


def test_the_readme_is_short_and_its_links_resolve():
    """The README says what ddptrain is and how to start; the rest lives in docs/ (the site's
    own links are checked by `make docs`, whose --strict build fails on a broken one)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert len(targets) >= 10
    missing = [t for t in targets if not t.startswith("http") and not (REPO / t).exists()]
    assert not missing, missing


def test_every_docs_page_is_in_the_sites_navigation():
    import yaml

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text().split("\nnav:", 1)[1].join(["nav:", ""]))["nav"]

    def pages(entries):
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from pages(value) if isinstance(value, list) else [value]
    assert set(pages(nav)) == {p.name for p in (REPO / "docs").glob("*.md")}


def test_the_architecture_table_names_every_part_of_the_package_and_nothing_else():
    """docs/development.md's Architecture table and `ls src/ddptrain` agree (subpackages and top modules)."""
    text = (REPO / "docs" / "development.md").read_text()
    section = text.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+(?:/|\.py))`", section.split("One training step")[0]))
    package = REPO / "src" / "ddptrain"
    parts = {f"{p.name}/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    parts |= {p.name for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert named == parts
