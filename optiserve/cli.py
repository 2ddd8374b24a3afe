"""The `optiserve` command: one subcommand per capability, each defined in its own package."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from optiserve import __version__
from optiserve.errors import UserError
from optiserve.machine import stated_flags

# subcommand -> (module with add_arguments(parser) and run(args) -> exit code, its one-line help); the
# help lives here so that `optiserve --help` lists the commands without importing any of them
COMMANDS = {
    "train": ("optiserve.train.command",
              "train a model with data-parallel SGD (run under torchrun for several processes or nodes)"),
    "optimize": ("optiserve.optimize.command",
                 "build, validate and package faster variants of a model (TorchScript, ONNX, INT8)"),
    "serve": ("optiserve.serve.command",
              "serve an artifact folder or a repository of them: /predict, the Open Inference Protocol (v2), /stats"),
    "bench": ("optiserve.bench.command",
              "measure latency and throughput: offline engine timings, or HTTP load against a server"),
    "compare": ("optiserve.bench.compare_command",
                "A/B latency report from bench results (or a running server's traffic): md, html, json, plots"),
    "tune": ("optiserve.bench.tune_command",
             "search variants x batch size x delay x instances for the highest throughput meeting a p99 objective "
             "(a model's, or each model's of a pipeline)"),
    "repair": ("optiserve.repair_command",
               "put back the previous version of an artifact folder whose publish was interrupted"),
}


# what each extra adds that a serve-only install lacks (import names), and the extra of each command
EXTRAS = {"train": {"torch", "torchvision", "sklearn", "tqdm"},
          "optimize": {"torch", "torchvision", "sklearn", "tqdm", "onnx", "onnxscript", "nncf"},
          "bench": {"httptools", "matplotlib", "sklearn"}}
EXTRA_OF_COMMAND = {"train": "train", "optimize": "optimize", "bench": "bench", "compare": "bench", "tune": "bench"}


def missing_extra(command: str, error: ModuleNotFoundError) -> str | None:
    """The one line for a command that needs a package this install lacks, or None."""
    package = (error.name or "").split(".")[0]
    own = EXTRA_OF_COMMAND.get(command)
    extra = own if own and package in EXTRAS[own] else next((e for e, held in EXTRAS.items() if package in held), None)
    if extra is None:
        return None
    return (f"optiserve {command}: error: needs {package}, which is not installed (a serve-only install): "
            f"pip install 'optiserve[{extra}]'")


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad command lines get one line naming the problem and where help is, not a usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given the command line `argv`, only its command's module is imported and its
    arguments added (`optiserve serve` must not import the trainer's torch and torchvision: seconds
    of start-up, and a serving image may not have them; `optiserve --help` imports none), without
    it every command's."""
    parser = OneLineErrorParser(prog="optiserve", description="Train, optimize, serve and measure vision and text models.")
    parser.add_argument("--version", action="version", version=f"optiserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv or [] if not a.startswith("-")), None)
    for name, (module_name, help_line) in COMMANDS.items():
        if argv is not None and name != chosen:
            sub.add_parser(name, help=help_line)  # not the command being run: only its name and help are needed
            continue
        importlib.import_module(module_name).add_arguments(sub.add_parser(name, help=help_line))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), "")
    try:
        parser = build_parser(argv)
    except ModuleNotFoundError as e:
        if (line := missing_extra(chosen, e)) is None:
            raise
        print(line, file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        stated_flags()  # a mistyped OPTISERVE_CPU_FLAGS is one line before any work, not an error mid-run
        return module.run(args)
    except ModuleNotFoundError as e:
        if (line := missing_extra(args.command, e)) is None:
            raise
        print(line, file=sys.stderr)
        return 2
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
