"""The ``glmc`` command line: subcommands registered in one table, errors printed as one line.

Every ``GlmcError`` (and every argparse usage error) becomes ``glmc: error: ...`` on stderr with
exit status 2. To add a subcommand, write ``add_arguments(parser)`` and ``run(args) -> int`` in
its own module and add one ``Command`` line to ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from glmc import __version__
from glmc.cli import align, barrier, check, export, merge, train
from glmc.cli.outputs import check_outputs
from glmc.errors import ConfigError, GlmcError

DEVICE_HELP = "auto (CUDA when there is one, the default), cpu, cuda or cuda:N"


@dataclass(frozen=True)
class Command:
    """One subcommand: its help line, its arguments, and what it runs."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # Alignment is many small ops: two OpenMP threads on a busy 2-core CPU made weight matching of a vit-bench
    # pair 37× slower than one (49.9 s against 1.3 s), so these commands default to one torch thread.
    single_threaded: bool = True


class _Formatter(argparse.HelpFormatter):
    """Help that states every option's default: argparse's own where the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        given = action.option_strings and not any(action.default is v for v in (None, False, argparse.SUPPRESS))
        return f"{text} (default: %(default)s)" if given and "default" not in text else text


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so errors stay one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


COMMANDS: dict[str, Command] = {
    "train": Command("train a preset on a dataset and save a checkpoint", train.add_train_arguments, train.run_train,
                     single_threaded=False),  # its own --threads (default: every core)
    "check": Command("check that every symmetry class leaves a model's function unchanged",
                     check.add_check_arguments, check.run_check),
    "align": Command("align checkpoint B to A and save B as a standard checkpoint",
                     align.add_align_arguments, align.run_align),
    "barrier": Command("loss barrier between two checkpoints, per alignment method",
                       barrier.add_barrier_arguments, barrier.run_barrier),
    "merge": Command("merge N checkpoints (any widths) into one standard checkpoint", merge.add_merge_arguments,
                     merge.run_merge),
    "export": Command("write a checkpoint as a Hugging Face folder, a timm state dict or a glmc checkpoint",
                      export.add_export_arguments, export.run_export),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of ``COMMANDS``."""
    parser = _Parser(prog="glmc", description="Align, merge and train Transformers through their symmetries.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command_parser = sub.add_parser(name, help=command.help, description=command.help, formatter_class=_Formatter)
        command.add_arguments(command_parser)
        if command.single_threaded:
            command_parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
        command_parser.add_argument("--device", default="auto", help=f"where to compute: {DEVICE_HELP}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``glmc`` console script; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        check_outputs(args)  # before any work: a bad --out, --json or --plot must not cost a run
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("glmc").setLevel(logging.WARNING if getattr(args, "quiet", False) else logging.INFO)
        if COMMANDS[args.command].single_threaded:
            from glmc.train import set_threads

            if args.threads < 0:
                raise ConfigError(f"--threads must be >= 0 (0: every core), got {args.threads}")
            set_threads(args.threads)
        from glmc.device import resolve

        args.device = str(resolve(args.device))  # an unknown device or a missing GPU is refused before any work
        return COMMANDS[args.command].run(args)
    except GlmcError as err:
        print(f"glmc: error: {err}", file=sys.stderr)
        return 2

