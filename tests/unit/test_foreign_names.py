"""Another trainer's setting names, as the docs map them (docs/from-nanogpt.md's and
docs/from-other-trainers.md's tables): each one given to ``ddptrain train`` is answered with one of
the row's own answers, in one line, exit 2; or it is ddptrain's flag already. A row added without a
working answer fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddptrain.cli import main
from ddptrain.settings import FIELDS, flag

DOCS = Path(__file__).parents[2] / "docs"


def _rows() -> list[tuple[str, str, list[str]]]:
    """(the page, another trainer's name, the row's answers: each backticked item's first word)."""
    rows = []
    for page in ("from-nanogpt.md", "from-other-trainers.md"):
        for line in (DOCS / page).read_text().splitlines():
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            if len(cells) < 2 or not cells[0].startswith("`"):
                continue  # (a header, its rule, or another table's row)
            names = [re.split(r"\s*=", name)[0] for name in re.findall(r"`([^`]+)`", cells[0])]
            names = [name for name in names if name.isidentifier()]  # (not a value: `'gpt2'`)
            answers = [item.split()[0] for item in re.findall(r"`([^`]+)`", cells[1])]
            if "same command" in cells[1]:
                answers.append("same command")
            rows += [(page, name, answers) for name in names]
    return rows


ROWS = _rows()


def test_the_tables_are_read():
    pages = {page for page, _, _ in ROWS}
    assert pages == {"from-nanogpt.md", "from-other-trainers.md"} and len(ROWS) > 50, ROWS
    assert all(answers for _, _, answers in ROWS), [row for row in ROWS if not row[2]]


@pytest.mark.parametrize("page,name,answers", ROWS, ids=[f"{page}:{name}" for page, name, _ in ROWS])
def test_each_name_another_trainer_uses_is_answered_with_the_row_s_answer(page, name, answers, capsys):
    if name in FIELDS:  # ddptrain's own name too: the row says so
        assert flag(name) in answers, (name, answers)
        return
    with pytest.raises(SystemExit) as exit_:
        main(["train", f"--{name}", "1"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, err
    assert any(answer in lines[0] for answer in answers), (name, answers, lines[0])


def test_a_switch_given_a_value_says_it_takes_none(capsys):
    """nanoGPT's `--compile=False`: argparse said 'ignored explicit argument'."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--compile=False"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err == (
        "ddptrain train: error: --compile is a switch and takes no value (got 'False'): give --compile to turn "
        "it on, --no-compile for off (see ddptrain train --help)"), err
