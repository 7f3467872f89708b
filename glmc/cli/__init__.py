"""The ``glmc`` command line: one module per subcommand (train, check, align, barrier, merge, export), the options
they share (pair, learn_options, weight_options, outputs) and the entry point (:mod:`glmc.cli.main`)."""

from glmc.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
