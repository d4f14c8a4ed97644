"""``ddptrain train | plan | env | report | export | lighthouse | bench``: parse, validate, then launch or
run as one rank.

Every mistake in the input is one line on stderr and exit status 2, before any rank starts
(or, when only the ranks can know it, before any training step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .errors import ConfigError
from .settings import FIELDS, SECTIONS, flag, section_purpose
from .settings.parsing import coerce, field_type


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        switch = re.match(r"argument (--[\w-]+)(?:/(--[\w-]+))?: ignored explicit argument '(.*)'$", message)
        if switch:  # --compile=False: a switch given a value
            off = f"{switch[2]} for off" if switch[2] else "leave it out for off"
            message = (f"{switch[1]} is a switch and takes no value (got {switch[3]!r}): give {switch[1]} to turn "
                       f"it on, {off}")
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _typed(field: str, flag_name: str) -> Any:
    """argparse's ``type=``: settings.coerce, the one conversion every way of giving a setting uses."""
    def convert(text: str) -> Any:
        try:
            return coerce(field, text, flag_name)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = field_type(field).__name__
    return convert


class _AddPairs(argparse.Action):
    """A flag of NAME=VALUE pairs given again adds its pairs to the earlier ones' (a name twice: one line)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        earlier = getattr(namespace, self.dest, "")
        try:
            setattr(namespace, self.dest, coerce(self.dest, f"{earlier},{values}" if earlier else values,
                                                 option_string or self.dest))
        except ConfigError as error:
            parser.error(str(error))


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, with its help text and default from its section's dataclass,
    grouped in ``--help`` by section (settings/sections.py), each with its line of purpose.

    Flags not given stay out of the namespace (SUPPRESS), so a --config file's value is
    kept unless the flag overrides it."""
    for section in SECTIONS:
        group = parser.add_argument_group(f"{section.SECTION} settings", section_purpose(section))
        for field in dataclasses.fields(section):
            _add_flag(group, field)


def _add_flag(group: argparse._ArgumentGroup, field: dataclasses.Field[Any]) -> None:
    meta, kind = field.metadata, field_type(field.name)
    names = [flag(field.name)] + ([meta["alias"]] if meta.get("alias") else [])
    default = field.default
    if kind is bool:
        group.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=meta["help"])
    elif meta["pairs"]:  # --task-opt a=1 --task-opt b=2: each adds its pairs
        group.add_argument(*names, dest=field.name, action=_AddPairs, type=_typed(field.name, names[0]),
                           default=argparse.SUPPRESS, help=meta["help"], metavar="NAME=VALUE")
    else:
        help_text = meta["help"] + ("" if default is None else f" (default: {default})")
        group.add_argument(*names, dest=field.name, type=_typed(field.name, names[0]), default=argparse.SUPPRESS,
                           choices=meta.get("choices"), help=help_text)


def _add_plan_parser(commands: Any) -> None:
    """``ddptrain plan``: train's flags, the target's shape and the machine's figures."""
    from .plan.hardware import Hardware

    plan = commands.add_parser("plan", help="a dry run of the job as a few ranks of its real world size (fake "
                               "process group, this machine's CPU): memory, collectives, snapshot, time, goodput; "
                               "refuses what would fail at that scale (exit 2)")
    plan.add_argument("--config", default=None, help="settings from a TOML file, a run's config.json or a nanoGPT "
                      "config/*.py, as for train")
    shape = plan.add_argument_group("the target", "the job's shape at the scale planned for")
    shape.add_argument("--world-size", type=int, default=None, help="ranks in all (or --nnodes x --nproc-per-node)")
    shape.add_argument("--nnodes", type=int, default=None, help="nodes (with --nproc-per-node)")
    shape.add_argument("--nproc-per-node", type=int, default=None, help="ranks (GPUs) per node (default: 8, or the "
                       "world size when smaller)")
    shape.add_argument("--ranks", default="0,-1", help="the ranks to run, negative from the end (default: 0,-1, "
                       "the first and the last)")
    shape.add_argument("--steps", type=int, default=None, help="optimizer steps each planned rank runs; the last "
                       "one's collectives are counted (default and fewest: 3 under ddp, whose second step rebuilds its "
                       "buckets; 1 otherwise, 2 for a stream, whose first step also agrees on a stand-in batch)")
    shape.add_argument("--fake-tensors", action="store_true", help="build the model and data, and run the steps, "
                       "with fake tensors (shapes without data): for a model that does not fit this machine's "
                       "memory; FSDP's wrapping then takes longer at many ranks")
    shape.add_argument("--global-batch", type=int, default=None, help="keep this global batch: --batch-size becomes "
                       "it over the ranks and --grad-accum (refused when it does not divide)")
    shape.add_argument("--json", action="store_true", help="the plan as JSON (for a CI gate before submitting)")
    shape.add_argument("--fit", action="store_true", help="plan the layouts (ddp, fsdp, hsdp across nodes; fsdp "
                       "and hsdp with each --tp that divides a node; activation checkpointing; batch x accumulation "
                       "at the same global batch) and rank those that fit --memory-per-rank by step time, with the "
                       "best one's train command (exit 2 when none fits)")
    figures = plan.add_argument_group("the machine", "figures the estimates start from (defaults: an H100 node)")
    hw = Hardware()
    for name, text in (("tflops", "achieved TFLOP/s per rank"), ("link_gbps", "one rank's network Gbit/s between "
                       "nodes"), ("node_gbps", "one rank's Gbit/s inside a node"), ("copy_gbs", "GB/s of a "
                       "snapshot's copy off the device (what blocks the step)"), ("write_gbs", "the file system's "
                       "write GB/s for the whole job"), ("start_seconds", "seconds a restarted job takes to start"),
                       ("rank_mttf_hours", "one rank's (GPU's) mean time to failure, hours: the job's is this over "
                        "the ranks, unless --mttf-hours gives the job's"),
                       ("latency_us", "microseconds one message between two ranks takes (a step of a ring or a "
                        "tree algorithm), whatever its size")):
        figures.add_argument(flag(name), dest=name,
                             type=float, default=getattr(hw, name), help=f"{text} (default: {getattr(hw, name):g})")
    figures.add_argument("--memory-per-rank", dest="memory_per_rank_gb", type=float, default=None, metavar="GB",
                         help="refuse a plan whose peak per rank is above this many GB")
    _add_config_flags(plan)


def build_parser() -> OneLineParser:
    from . import __version__

    parser = OneLineParser(prog="ddptrain", description="DistributedDataParallel training "
                           "that works the same under every launcher.")
    parser.add_argument("--version", action="version", version=f"ddptrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    train = commands.add_parser("train", help="train a task on every local GPU (or CPU ranks), "
                                "or as one rank under torchrun / srun")
    train.add_argument("--config", default=None, help="settings from a TOML file (keys are the flag "
                       "names, at the top or in their section's table: [snapshots] save-every = 100), a run's "
                       "config.json or a nanoGPT config/*.py (read as data, never run); flags given here win")
    _add_config_flags(train)
    # torch.distributed.launch without --use-env passes this to every rank.
    train.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int,
                       default=None, help=argparse.SUPPRESS)
    _add_plan_parser(commands)
    commands.add_parser("env", help="what torch, CUDA and the launcher look like from here")
    report = commands.add_parser("report", help="summary table, goodput over every attempt, curves.png and "
                                 "goodput.png of a run")
    report.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    report.add_argument("--json", action="store_true", help="print the summary, goodput's parts and the curves' "
                        "series (by step) as JSON")
    report.add_argument("--sync", default=None, metavar="TRACKER",
                        help="send the run's records that TRACKER (mlflow, wandb, csv, tensorboard) missed, "
                        "each step once, to the same tracker run; 'store': upload what this machine's mirror "
                        "of an s3:// run dir holds and the store lacks (a run that ended while it was down)")
    export = commands.add_parser("export", help="a run's weights as safetensors, a Hugging Face folder, "
                                 "or a plain torch state_dict")
    export.add_argument("run_dir", help="a run directory (its model.pt, or --snapshot N)")
    export.add_argument("--format", choices=("safetensors", "hf", "torch"), default="safetensors")
    export.add_argument("--snapshot", type=int, default=None, metavar="N",
                        help="the snapshot of global step N instead of model.pt (an FSDP run's DCP folder too)")
    export.add_argument("--best", action="store_true",
                        help="the best evaluation's weights (best/model.pt of a run trained with --keep-best)")
    export.add_argument("--ema", action="store_true",
                        help="the weights' moving average at the end (ema/model.pt of a run trained with --ema)")
    export.add_argument("--merge", action="store_true",
                        help="--format hf of a LoRA (PEFT) run: the base model with the adapter merged in, "
                        "instead of the adapter alone")
    export.add_argument("--out", required=True, help="the file (safetensors, torch) or folder (hf) to write")
    export.add_argument("--force", action="store_true", help="replace --out if it exists")
    lighthouse = commands.add_parser("lighthouse", help="torchft's lighthouse, which the replica groups of "
                                     "--fault-tolerance torchft meet at each step (runs until stopped)")
    lighthouse.add_argument("--bind", default="127.0.0.1:29510", metavar="HOST:PORT",
                            help="where it listens (default: loopback only, 127.0.0.1:29510; 0.0.0.0:PORT for "
                            "groups on other machines)")
    lighthouse.add_argument("--min-replicas", type=int, default=1,
                            help="the fewest replica groups that may train a step (default: 1, so any group "
                            "trains on alone)")
    lighthouse.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                            help="how long a group may be silent before it counts as failed (default: 5000)")
    lighthouse.add_argument("--join-timeout-ms", type=int, default=60000,
                            help="how long a quorum waits for a group that is alive but late (default: 60000)")
    commands.add_parser("bench", help="benchmark ddptrain against hand-written DDP loops and peers "
                        "(see ddptrain bench --help)")
    return parser


def _nearest(unknown: list[str], command: str) -> str:
    """``; did you mean --log-every?`` for the first unknown flag of ``train`` that is close to one
    (or another trainer's name for one: settings.parsing.hint_for)."""
    if command != "train":
        return ""
    from .settings.parsing import hint_for

    for word in unknown:
        if word.startswith("--") and (hint := hint_for(word.split("=", 1)[0])):
            return f"; {hint}"
    return ""


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (not their defaults)."""
    return {name: getattr(args, name) for name in FIELDS if hasattr(args, name)}


def train(args: argparse.Namespace) -> int:
    from .api import execute, prepare
    from .errors import TrainingFailed
    from .observe.goodput import LAUNCHED_AT, process_started_at

    launched = LAUNCHED_AT not in os.environ
    os.environ.setdefault(LAUNCHED_AT, str(process_started_at()))  # this process's start is the attempt's
    try:
        cfg, factory = prepare(None, given_options(args), args.config)  # torch is not imported before this
        outcome, rank = execute(cfg, factory, args.local_rank, leave_on_failure=True)
    except TrainingFailed as failure:
        from .console import say

        say(str(failure), sys.stderr)
        return failure.exit_code
    finally:
        if launched:  # (main() may run inside a test or a script)
            os.environ.pop(LAUNCHED_AT, None)
    from .launch.rank import exit_for

    return exit_for(outcome, is_main=rank == 0)


def report(args: argparse.Namespace) -> int:
    from .observe.goodput import UNKNOWN, account, goodput_table, plot_timeline, read_timeline
    from .observe.summary import format_summary, plot_curves, summarize
    from .run_dir import RunDir

    if args.sync == "store":
        print(sync_store(args.run_dir))  # first: the report then reads what the store holds
    elif args.sync:  # a wrong name is refused before anything is printed, written or fetched
        from .observe.trackers import tracker_named

        tracker_named(args.sync)
    run_dir = RunDir.of(args.run_dir).readable()  # a store's run: copied down beside its mirror
    if not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError(f"{args.run_dir}: no metrics.jsonl here; give the --run-dir of a run")
    summary = summarize(run_dir)
    found = account(read_timeline(run_dir))
    if args.json:  # for machines: the summary, goodput's parts and the curves' series, nothing else
        from .observe.summary import curve_series, read_metrics

        print(json.dumps({"summary": summary, "goodput": found, "curves": curve_series(read_metrics(run_dir))},
                         indent=2))
        return 0
    print(format_summary(summary) if summary else f"{run_dir}: no epoch finished yet")
    note = plot_curves(run_dir)
    print(note or f"curves: {run_dir / 'curves.png'}")
    print(UNKNOWN if found is None else goodput_table(found))
    if found is not None:
        print(plot_timeline(run_dir) or f"timeline: {run_dir / 'goodput.png'}")
    if (run_dir / "model.pt").is_file():
        from .export import export_command_hint

        print(export_command_hint(args.run_dir))
    for kept in ("best", "ema"):
        if (run_dir / kept / "model.pt").is_file():
            from .export import export_command_hint

            print(export_command_hint(args.run_dir, kept))
    if args.sync and args.sync != "store":
        print(sync_tracker(run_dir, args.sync, summary))
    return 0


def sync_store(url: str) -> str:
    """``report URL --sync store``: this machine's mirror's uploads that never happened."""
    from .run_dir import RunDir, StoreRunDir
    from .settings import RunConfig
    from .snapshots.uploads import sync_line, sync_up

    remote = RunDir.of(url)
    if not isinstance(remote, StoreRunDir):
        raise ConfigError(f"--sync store: {url} is a local folder; give the run dir on a store (s3://BUCKET/PREFIX) "
                          "whose mirror on this machine holds what it lacks")
    remote.check_url(flag="run dir")
    mirror = remote.local
    if not mirror.is_dir():
        raise ConfigError(f"--sync store: this machine has no mirror of {url} ({mirror}); run it on the machine "
                          "that trained it")
    remote.check(flag="run dir")
    config = json.loads((mirror / "config.json").read_text()) if (mirror / "config.json").is_file() else {}
    try:
        sent = sync_up(remote, int(config.get("keep") or RunConfig().keep))
    except Exception as error:  # noqa: BLE001 - every client's own errors
        text = " ".join(str(error).split())[:160]
        raise ConfigError(f"--sync store: {url} failed ({type(error).__name__}: {text}); nothing in {mirror} was "
                          "removed: run this again once it answers") from None
    return sync_line(url, sent)


def sync_tracker(run_dir: Path, name: str, summary: dict[str, Any]) -> str:
    from .observe.summary import read_metrics
    from .observe.trackers import tracker_named
    from .observe.tracking import sync

    tracker = tracker_named(name)
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    sent, held = sync(tracker, run_dir, read_metrics(run_dir), config,
                      [run_dir / "config.json", run_dir / "curves.png"], summary)
    return f"{name}: sent {sent} value(s) it was missing; it already held {held}"


def export_command(args: argparse.Namespace) -> int:
    from .export import check_out, export
    from .run_dir import RunDir

    out = Path(args.out)
    check_out(out, args.force)  # before anything is fetched or read
    run_dir = RunDir.of(args.run_dir).readable(snapshots=args.snapshot is not None)
    kept = [name for name in ("best", "ema") if getattr(args, name)]
    if len(kept) + (args.snapshot is not None) > 1:
        raise ConfigError("export: give one of --best, --ema and --snapshot N")
    print(export(run_dir, args.format, out, args.snapshot, args.force, shown=args.run_dir,
                 kept=kept[0] if kept else None, merge=args.merge))
    return 0


def plan_command(args: argparse.Namespace) -> int:
    from .api import prepare
    from .plan.command import plan_job

    given = given_options(args)
    return plan_job(args, lambda: prepare(None, given, args.config), given)  # (train's checks)


def env_command(args: argparse.Namespace) -> int:
    from .launch.envinfo import environment_report

    print(json.dumps(environment_report(), indent=2))
    return 0


def lighthouse_command(args: argparse.Namespace) -> int:
    from .resilience.lighthouse import serve

    return serve(args.bind, args.min_replicas, args.heartbeat_timeout_ms, args.join_timeout_ms)


COMMANDS = {"train": train, "plan": plan_command, "env": env_command, "report": report, "export": export_command,
            "lighthouse": lighthouse_command}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser (bench/cli.py): every flag after "bench" is its
        from .bench.cli import main as bench_main
        return bench_main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the subcommand, whose --help lists its flags
        parser.exit(2, f"ddptrain {args.command}: error: unrecognized arguments: "
                       f"{' '.join(unknown)}{_nearest(unknown, args.command)} (see ddptrain {args.command} --help)\n")
    try:
        return COMMANDS[args.command](args)
    except ConfigError as error:
        print(f"ddptrain: error: {error}", file=sys.stderr)
        return 2
