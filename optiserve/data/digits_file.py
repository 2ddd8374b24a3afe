"""scikit-learn's bundled 1,797 handwritten digits, read from the file scikit-learn ships.

Read directly rather than through `sklearn.datasets` (seconds of imports in every process that loads
them: a training worker, the optimizer, the load client); tests hold it equal to `load_digits()`."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

from optiserve.errors import UserError


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images [1797, 8, 8] float64 in 0..16, labels [1797] int): `load_digits()`'s images and target."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the digits dataset comes with scikit-learn, which is not installed (a serve-only install): "
                        "pip install scikit-learn (in the [train], [optimize] and [bench] extras)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    try:
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",")
    except (OSError, ValueError) as e:
        raise UserError(f"the digits dataset could not be read from scikit-learn's {path} ({e}): reinstall "
                        f"scikit-learn") from None
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
