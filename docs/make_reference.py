"""The reference's tables, generated from the code: every setting by section (flags.md and
reference.md), Task's fields and the public exceptions (reference.md). A flag's help, a field's
line and an exception's docstring each live in one place, the code; ``make reference`` rewrites
the blocks between ``<!-- begin generated: NAME -->`` and ``<!-- end generated: NAME -->``, and
``make docs`` (so CI) and tests/unit/test_reference.py fail when a committed page differs from
what this writes.

    python docs/make_reference.py          # rewrite the generated blocks
    python docs/make_reference.py --check  # exit 1 if a page is out of date
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path

from ddptrain import errors
from ddptrain.settings import SECTIONS, Section, flag, section_purpose
from ddptrain.tasks.protocol import Task

DOCS = Path(__file__).parent
# Where each section's concern is told at length.
MORE = {"training": "guide.md", "optim": "from-nanogpt.md", "parallel": "fsdp.md", "launch": "launch.md",
        "resilience": "fault-tolerance.md", "snapshots": "fault-tolerance.md", "evaluation": "guide.md",
        "observe": "storage-and-trackers.md"}
BLOCK = re.compile(r"(<!-- begin generated: (\w+) -->\n)(.*?)(<!-- end generated: \2 -->)", re.S)


def cell(text: str) -> str:
    """Text for a Markdown table's cell: argparse's %% as %, pipes escaped."""
    return text.replace("%%", "%").replace("|", "\\|")


def setting_type(field: dataclasses.Field) -> str:
    choices = field.metadata["choices"]
    kind = " \\| ".join(choices) if choices else str(field.type).replace(" | None", "")
    return kind + (", list" if field.metadata["many"] else "")


def default_of(field: dataclasses.Field) -> str:
    if field.default is None:
        return "unset"
    if isinstance(field.default, bool):
        return "on" if field.default else "off"
    return f"`{field.default}`" if field.default != "" else "none"


def settings_tables(section: type[Section], *, full: bool) -> list[str]:
    """A section's settings: flag, type, default and (``full``) what it does."""
    lines = [f"{'##' if full else '###'} {section.SECTION}", "", f"{section_purpose(section)} "
             f"(`{section.__name__}`, `cfg.{section.SECTION}`; more in [{MORE[section.SECTION]}]"
             f"({MORE[section.SECTION]}))", ""]
    lines += (["| flag | type | default | what it does |", "|---|---|---|---|"] if full
              else ["| setting | type | default |", "|---|---|---|"])
    for field in dataclasses.fields(section):
        names = ", ".join(f"`{n}`" for n in [flag(field.name), field.metadata["alias"]] if n)
        row = [names if full else f"`{field.name}`", setting_type(field), default_of(field)]
        lines.append("| " + " | ".join(row + ([cell(field.metadata["help"])] if full else [])) + " |")
    return lines + [""]


def task_table() -> list[str]:
    lines = ["| field | type | what it is |", "|---|---|---|"]
    for field in dataclasses.fields(Task):
        default = "" if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING \
            else " (optional)"
        lines.append(f"| `{field.name}`{default} | `{cell(str(field.type))}` | {cell(field.metadata['help'])} |")
    return lines + [""]


def public_exceptions() -> list[type[BaseException]]:
    return [kind for name, kind in vars(errors).items()
            if inspect.isclass(kind) and issubclass(kind, BaseException) and kind.__module__ == errors.__name__
            and not name.startswith("_")]


def exceptions_table() -> list[str]:
    lines = ["| exception | base | raised when |", "|---|---|---|"]
    for kind in public_exceptions():
        said = " ".join((kind.__doc__ or "").split())
        lines.append(f"| `ddptrain.errors.{kind.__name__}` | `{kind.__bases__[0].__name__}` | {cell(said)} |")
    return lines + [""]


GENERATED = {
    "settings": lambda: [line for s in SECTIONS for line in settings_tables(s, full=True)],
    "settings_summary": lambda: [line for s in SECTIONS for line in settings_tables(s, full=False)],
    "task": task_table,
    "exceptions": exceptions_table,
}


def render(text: str) -> str:
    """``text`` with every generated block written anew."""
    return BLOCK.sub(lambda m: m.group(1) + "\n".join(GENERATED[m.group(2)]()) + "\n" + m.group(4), text)


PAGES = ("flags.md", "reference.md")


def main(argv: list[str]) -> int:
    stale = []
    for name in PAGES:
        page = DOCS / name
        text = page.read_text()
        if render(text) != text:
            stale.append(name)
            if "--check" not in argv:
                page.write_text(render(text))
    if stale and "--check" in argv:
        print(f"out of date: {', '.join(stale)}; run `make reference`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
