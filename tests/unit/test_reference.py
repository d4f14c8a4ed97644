"""The reference shows everything a user types, from one source: every setting's, Task field's and
public exception's text lives in the code, `--help` and the docs' tables are made from it."""

import dataclasses
import importlib.util

from ddptrain.cli import build_parser
from ddptrain.settings import FIELDS, SECTIONS, flag
from ddptrain.tasks.protocol import Task
from helpers.commands import REPO

spec = importlib.util.spec_from_file_location("make_reference", REPO / "docs" / "make_reference.py")
make_reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_reference)


def test_every_setting_task_field_and_exception_has_its_text():
    for name, field in FIELDS.items():
        assert len(field.metadata["help"].split()) >= 4, f"the setting {name} has no help text"
    for field in dataclasses.fields(Task):
        assert len(field.metadata.get("help", "").split()) >= 4, f"Task.{field.name} has no help text"
    exceptions = make_reference.public_exceptions()
    assert {"ConfigError", "TrainingFailed", "Stopped", "SnapshotError"} <= {kind.__name__ for kind in exceptions}
    for kind in exceptions:
        assert kind.__doc__ and len(kind.__doc__.split()) >= 4, f"{kind.__name__} has no docstring"


def test_the_generated_pages_are_what_the_code_says():
    for name in make_reference.PAGES:
        text = (REPO / "docs" / name).read_text()
        assert make_reference.render(text) == text, f"docs/{name} is out of date: run `make reference`"
    flags, reference = ((REPO / "docs" / name).read_text() for name in make_reference.PAGES)
    for name in FIELDS:  # each setting in both: a flag with its help, a field with its type and default
        assert f"| `{flag(name)}`" in flags and f"| `{name}` |" in reference
    for field in dataclasses.fields(Task):
        assert f"| `{field.name}`" in reference


def test_help_groups_the_flags_by_section():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    groups = {group.title: {action.dest for action in group._group_actions} for group in train._action_groups}
    for section in SECTIONS:
        assert groups[f"{section.SECTION} settings"] == {f.name for f in dataclasses.fields(section)}
    assert "save-every" in train.format_help().split("snapshots settings:")[1].split("settings:")[0]
