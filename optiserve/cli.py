"""The `optiserve` command: one subcommand per capability, each defined in its own package."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from optiserve import __version__
from optiserve.errors import UserError

# subcommand -> module with HELP, add_arguments(parser) and run(args) -> exit code
COMMANDS = {
    "train": "optiserve.train.command",
    "optimize": "optiserve.optimize.command",
    "serve": "optiserve.serve.command",
    "bench": "optiserve.bench.command",
    "compare": "optiserve.bench.compare_command",
    "repair": "optiserve.repair_command",
}


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad command lines get one line naming the problem and where help is, not a usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="optiserve", description="Train, optimize, serve and measure vision models.")
    parser.add_argument("--version", action="version", version=f"optiserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command])
    try:
        return module.run(args)
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one line rather than one per process
            print(f"optiserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"optiserve {args.command}: interrupted", file=sys.stderr)
        return 130


def optimize_main(argv: list[str] | None = None) -> int:
    """The `optimize` console script: the same as `optiserve optimize`."""
    return main(["optimize", *(sys.argv[1:] if argv is None else argv)])
