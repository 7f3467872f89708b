"""The ``glmc`` command line: one module per subcommand (train, check, align, barrier, merge, export), the options
they share (pair, options, data_options, outputs) and the entry point (:mod:`glmc.cli.main`)."""

from glmc.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
