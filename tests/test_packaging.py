"""What pyproject.toml promises installs: each extra brings the packages its commands read with, and
the metadata is what current setuptools accepts without a deprecation warning."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())


def requirements_of(extra: str) -> set[str]:
    """The distribution names an extra installs, following `optiserve[...]` references."""
    project = PYPROJECT["project"]
    names = set()
    for requirement in project["optional-dependencies"][extra]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        if name == "optiserve":
            for inner in re.search(r"\[(.*)\]", requirement).group(1).split(","):
                names |= requirements_of(inner.strip())
        else:
            names.add(name)
    return names


def test_optimize_reads_the_safetensors_weights_the_docs_advertise():
    from optiserve.models.weights import WEIGHT_CHOICES

    assert ".safetensors" in WEIGHT_CHOICES
    assert "safetensors" in requirements_of("optimize")
    assert "safetensors" in requirements_of("all")


def test_the_license_is_an_spdx_expression_not_the_deprecated_table():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    setuptools = next(r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(re.search(r">=(\d+)", setuptools).group(1)) >= 77  # the first to read an SPDX string
