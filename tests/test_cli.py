"""The command line: subcommands that exist, documented options, one-line errors."""

import argparse

import pytest

from conftest import ROOT, run_cli
from optiserve.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _commands(parser: argparse.ArgumentParser, prefix: str = "optiserve"):
    """Every (command line, parser), nested subcommands such as `optiserve bench http` included."""
    for name, sub in _subparsers(parser).items():
        yield f"{prefix} {name}", sub
        if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
            yield from _commands(sub, f"{prefix} {name}")


REFERENCE = ("docs/cli.md", "docs/optimizer.md", "docs/serving.md")  # the CLI reference's pages


def test_every_option_of_every_subcommand_is_in_the_cli_reference():
    reference = "".join((ROOT / page).read_text() for page in REFERENCE)
    for command, sub in _commands(build_parser()):
        assert command in reference
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in reference, f"{command} {flag} is not documented in {', '.join(REFERENCE)}"


def test_help_lists_the_documented_subcommands_and_each_has_working_help(capsys):
    documented = {"train", "optimize", "serve", "bench", "compare", "tune", "repair"}  # the CLI reference
    proc = run_cli("--help")
    assert proc.returncode == 0
    section = proc.stdout.split("positional arguments:", 1)[1].split("options:", 1)[0]
    listed = {line.split()[0] for line in section.splitlines()[2:] if line.startswith("    ") and not line.startswith("      ")}
    assert listed == documented, proc.stdout
    for name in sorted(documented):  # each through the same parser, in this process
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([name, "--help"])
        assert exit_.value.code == 0 and f"usage: optiserve {name}" in capsys.readouterr().out


def test_an_invalid_choice_is_one_line_naming_the_fix():
    proc = run_cli("train", "small_cnn", "--amp", "fp8")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("optiserve train: error: argument --amp: invalid choice: 'fp8' "
                                   "(choose from 'auto', 'bf16', 'fp16', 'off') (see optiserve train --help)")


def test_the_command_list_imports_no_command():
    """`optiserve --help` (or a mistyped command) lists the commands without importing torch or any of them."""
    import subprocess
    import sys

    code = ("import sys, optiserve.cli as cli; cli.build_parser(['--help']); cli.build_parser(['srve']); "
            "print(sorted(m for m in sys.modules if m in ('torch', 'fastapi', 'sklearn') or m.endswith('command')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
    assert "search variants x batch size" in run_cli("--help").stdout  # each command's help line, still listed


def test_the_cli_parser_does_not_import_the_web_stack():
    """`train` and `optimize` must work where FastAPI is not installed (seen on a GPU machine)."""
    import subprocess
    import sys

    code = ("import sys, optiserve.cli as cli; cli.build_parser(); "
            "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
