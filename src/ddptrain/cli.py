"""``ddptrain train | env | report | bench``: parse, validate, then launch or run as one rank.

Every mistake in the input is one line on stderr and exit status 2, before any rank starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .config import ConfigError, RunConfig, default_run_dir, parse_nproc, validate


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _field_type(field: dataclasses.Field[Any]) -> type:
    hint = typing.get_type_hints(RunConfig)[field.name]
    if isinstance(hint, types.UnionType):  # "X | None"
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per RunConfig field, with its help text and default from the dataclass."""
    for field in dataclasses.fields(RunConfig):
        meta, kind = field.metadata, _field_type(field)
        names = ["--" + field.name.replace("_", "-")]
        if meta.get("alias"):
            names.append(meta["alias"])
        default = field.default
        help_text = meta["help"] + ("" if default is None else f" (default: {default})")
        if kind is bool:
            parser.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction,
                                default=default, help=meta["help"])
        else:
            parser.add_argument(*names, dest=field.name, type=_typed(kind, names[0]),
                                default=default, choices=meta.get("choices"), help=help_text)


_KIND_NAMES = {int: "a whole number", float: "a number", str: "text"}


def _typed(kind: type, flag: str) -> Any:
    def convert(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} needs {_KIND_NAMES[kind]}, got {text!r}") from None
    convert.__name__ = kind.__name__
    return convert


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="ddptrain", description="DistributedDataParallel training "
                           "that works the same under every launcher.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    train = commands.add_parser("train", help="train a task on every local GPU (or CPU ranks), "
                                "or as one rank under torchrun / srun")
    _add_config_flags(train)
    # torch.distributed.launch without --use-env passes this to every rank.
    train.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int,
                       default=None, help=argparse.SUPPRESS)
    commands.add_parser("env", help="what torch, CUDA and the launcher look like from here")
    report = commands.add_parser("report", help="summary table and curves.png of a finished run")
    report.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    commands.add_parser("bench", help="benchmark ddptrain against hand-written DDP loops "
                        "(see ddptrain bench --help)")
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig)}
    return RunConfig(**values)


def train(args: argparse.Namespace) -> int:
    from . import tasks
    from .dist import check_comm_hook, resolve_device_kind
    from .environments import LocalEnvironment, detect
    from .worker import exit_for, run_rank

    cfg = config_from_args(args)
    validate(cfg)
    tasks.resolve_factory(cfg.task)  # import errors before any rank starts
    env = detect(local_rank_arg=args.local_rank)
    if not isinstance(env, LocalEnvironment):  # torchrun or srun started this process
        return exit_for(run_rank(cfg, args.local_rank), is_main=env.rank == 0)
    from .launch import auto_nproc, launch_local

    nproc = parse_nproc(cfg.nproc) or auto_nproc(cfg.device)
    device_kind, backend = resolve_device_kind(cfg.device, cfg.backend, nproc)
    check_comm_hook(cfg.comm_hook, backend)
    cfg.run_dir = cfg.run_dir or default_run_dir()
    return launch_local(cfg, nproc, device_kind)


def report(args: argparse.Namespace) -> int:
    from .report import format_summary, plot_curves, summarize

    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError(f"{run_dir}: no metrics.jsonl here; give the --run-dir of a run")
    summary = summarize(run_dir)
    print(format_summary(summary) if summary else f"{run_dir}: no epoch finished yet")
    note = plot_curves(run_dir)
    print(note or f"curves: {run_dir / 'curves.png'}")
    return 0


def env_command(args: argparse.Namespace) -> int:
    from .envinfo import environment_report

    print(json.dumps(environment_report(), indent=2))
    return 0


COMMANDS = {"train": train, "env": env_command, "report": report}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser (bench.py): every flag after "bench" is its
        from .bench import main as bench_main
        return bench_main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the subcommand, whose --help lists its flags
        parser.exit(2, f"ddptrain {args.command}: error: unrecognized arguments: "
                       f"{' '.join(unknown)} (see ddptrain {args.command} --help)\n")
    try:
        return COMMANDS[args.command](args)
    except ConfigError as error:
        print(f"ddptrain: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
