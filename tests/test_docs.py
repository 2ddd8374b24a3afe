"""The README and docs/ as a reader meets them: every relative link leads somewhere that exists
(a file, and the heading its #anchor names), and every command the README shows parses with the
real command-line parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import ROOT
from optiserve.cli import build_parser

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = CODE_BLOCK.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        anchor = github_anchor(heading)
        n = seen.get(anchor, 0)
        seen[anchor] = n + 1
        out.add(anchor if n == 0 else f"{anchor}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = CODE_BLOCK.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans show link syntax, they do not link
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:: not ours to check offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def readme_commands() -> list[str]:
    """Each `optiserve ...` or `optimize ...` command line in the README's shell blocks (under torchrun
    too), joined over backslash continuations, without comments and the trailing `&`."""
    commands = []
    for block in CODE_BLOCK.findall((ROOT / "README.md").read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", line):
                words = shlex.split(part, comments=True)
                if words and words[-1] == "&":
                    words = words[:-1]
                if words[:1] == ["torchrun"] and "optiserve" in words:  # torchrun [its options] -m optiserve ...
                    words = words[words.index("optiserve"):]
                if words and words[0] in ("optiserve", "optimize"):
                    commands.append(words)
    return commands


def test_the_readme_shows_commands():
    assert len(readme_commands()) >= 6


@pytest.mark.parametrize("words", readme_commands(), ids=lambda w: " ".join(w)[:60])
def test_every_command_in_the_readme_parses(words: list[str]):
    argv = words[1:] if words[0] == "optiserve" else ["optimize", *words[1:]]
    args = build_parser(argv).parse_args(argv)
    assert args.command == argv[0]
