"""Every documented command still works, and prints what the docs say it prints.

Fenced blocks in README.md and docs/*.md whose info string is ``sh run`` are run, each block
as one bash script that stops at the first failing line, in a scratch folder holding a copy
of examples/ (CPU, OMP_NUM_THREADS=1). A ``text`` block right after a run block shows what it
prints: each of its lines must appear in the output, in that order, where ``…`` stands for
what differs from run to run (rates, times). Blocks marked ``sh gpu`` or ``sh cluster``
cannot run here: their ddptrain arguments must parse, `ddptrain <command> --help` must
succeed, and scripts they name must exist and pass `bash -n`.
"""

import concurrent.futures
import functools
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from ddptrain.cli import build_parser
from helpers.commands import BIN, REPO, clean_env, run

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S+)(?: ([\w ]+))?\n(.*?)^```\n", re.S | re.M)


def blocks(kind: str) -> list[tuple[str, str, str | None]]:
    """(document, block text, the text block it prints or None) for every ``sh <kind>`` block."""
    found = []
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


def test_docs_mark_commands_and_show_their_output():
    assert len(blocks("run")) >= 10 and commands("cluster") and commands("gpu")
    assert sum(shows is not None for _, _, shows in blocks("run")) >= 6


def _pattern(line: str) -> re.Pattern[str]:
    return re.compile("^" + ".*?".join(re.escape(part) for part in line.rstrip().split("…")) + r"\s*$")


def assert_shows(output: str, shown: str, where: str) -> None:
    """Each shown line matches an output line, in order (other output lines may come between)."""
    lines = output.splitlines()
    position = 0
    for expected in (line for line in shown.splitlines() if line.strip()):
        pattern = _pattern(expected)
        while position < len(lines) and not pattern.match(lines[position]):
            position += 1
        assert position < len(lines), f"{where}: the docs show\n  {expected}\nbut the command printed:\n{output}"
        position += 1


RUN_BLOCKS = blocks("run")


@pytest.fixture(scope="module")
def block_results(tmp_path_factory):
    """Every run block's output, two blocks at a time (each in a scratch folder of its own, on
    ports the OS picks: they only share the CPUs, and nothing here measures time)."""
    env = clean_env()
    env["PATH"] = f"{BIN}:{env['PATH']}"

    def execute(folder: Path, command: str) -> subprocess.CompletedProcess[str]:
        shutil.copytree(REPO / "examples", folder / "examples")
        return run(["bash", "-e", "-c", f"exec 2>&1\n{command}"], env=env, cwd=folder, timeout=300)

    # The scratch folders are made here, one thread: mktemp numbers its folders (and makes pytest's
    # base folder on first use) without a lock, and two threads once got the same one.
    folders = [tmp_path_factory.mktemp("block") for _ in RUN_BLOCKS]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(execute, folders, [command for _, command, _ in RUN_BLOCKS]))


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RUN_BLOCKS)),
                         ids=[f"{doc}-{command.splitlines()[0][:50]}" for doc, command, _ in RUN_BLOCKS])
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


def test_shown_output_is_matched_line_by_line_in_order():
    output = "training x\nepoch 0 | 12,345 samples/s\nnoise\nsummary\n"
    assert_shows(output, "epoch 0 | … samples/s\nsummary\n", "here")
    with pytest.raises(AssertionError, match="the docs show"):
        assert_shows(output, "summary\nepoch 0 | … samples/s\n", "here")  # the order matters


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
