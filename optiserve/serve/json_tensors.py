"""A JSON body's tensor read straight into an array: simdjson parses the body and copies the nested
list of numbers at one path into a float64 buffer, so no Python float is built per value (the
standard parser builds one for each, which is what made large JSON tensors slow). Everything else in
the body becomes the same Python values `json.loads` gives.

Only what the fast path can read exactly is read here: a body it cannot parse (malformed, NaN, an
integer past 64 bits, nested too deep) or that is not a JSON object gives None, and the caller's
standard parser reads it and says what is wrong, in its own words.
"""

from __future__ import annotations

import math

import numpy as np

Path = tuple  # keys and list indices from the top object to the tensor, e.g. ("inputs", 0, "data")


def read_with_tensor(data: bytes, path: Path) -> dict | None:
    """The JSON object `data` with the value at `path` as a float64 ndarray of its shape where it is
    a regular (possibly nested) list of numbers, else as json gives it; None where simdjson cannot
    read `data` as an object."""
    try:
        import simdjson
    except ImportError:  # a build without the wheel: the standard parser does it all
        return None
    parser = simdjson.Parser()  # one per body: a parser is not shared while its results are alive
    try:
        doc = parser.parse(data)
    except Exception:  # noqa: BLE001  any reason simdjson has: the standard parser gives the user's error
        return None
    try:
        if not isinstance(doc, simdjson.Object):
            return None
        return _with_tensor(doc, path, simdjson)
    finally:
        del doc  # the proxies go before their parser


def _with_tensor(node, path: Path, sj):
    if not path:
        tensor = _tensor(node, sj)
        return _python(node, sj) if tensor is None else tensor
    key, rest = path[0], path[1:]
    if isinstance(key, str) and isinstance(node, sj.Object):
        return {k: (_with_tensor(node[k], rest, sj) if k == key else _python(node[k], sj)) for k in node.keys()}
    if isinstance(key, int) and isinstance(node, sj.Array):
        return [(_with_tensor(v, rest, sj) if i == key else _python(v, sj)) for i, v in enumerate(node)]
    return _python(node, sj)


def _python(node, sj):
    """What json.loads gives for this part of the document."""
    if isinstance(node, sj.Object):
        return node.as_dict()
    if isinstance(node, sj.Array):
        return node.as_list()
    return node


def _tensor(node, sj) -> np.ndarray | None:
    """A regular nested list of numbers as a float64 array of its shape; None for anything else."""
    shape, first = [], node
    while isinstance(first, sj.Array):
        if len(first) == 0:
            return None
        shape.append(len(first))
        first = first[0]
    if not shape or isinstance(first, bool) or not isinstance(first, (int, float)):
        return None
    try:
        flat = np.frombuffer(node.as_buffer(of_type="d"), dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):  # a string, a bool or null among the numbers
        return None
    if flat.size != math.prod(shape) or not _regular(node, shape, sj):
        return None
    return flat.reshape(shape)


def _regular(node, shape: list[int], sj) -> bool:
    """Whether every list at every depth has its shape's length (as_buffer flattens ragged lists too)."""
    level = [node]
    for size in shape[:-1]:
        below = []
        for lst in level:
            if not isinstance(lst, sj.Array) or len(lst) != size:
                return False
            below.extend(lst)
        level = below
    return all(isinstance(lst, sj.Array) and len(lst) == shape[-1] for lst in level)
