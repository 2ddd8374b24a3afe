"""A JSON body's tensor read straight into an array: simdjson parses the body and copies the nested
list of numbers at one path into a float64 buffer, so no Python float is built per value (the
standard parser builds one for each, which is what made large JSON tensors slow). Everything else in
the body becomes the same Python values `json.loads` gives.

The fast path answers only where its answer is provably the standard parser's; every other body
gives None, and the caller's standard parser reads it and says what is wrong, in its own words:
one that simdjson cannot parse (malformed, NaN, an integer past 64 bits), that is not a JSON object,
that may hold a number longer than the standard parser takes, that repeats a key in an object on the
path to the tensor (simdjson looks up a key's first value, json keeps its last) or has a key there
holding a NUL (simdjson looks a key up only up to it), that is nested
deeper than MAX_DEPTH (the standard parser's own limit depends on the stack it runs on), or whose
'[' count is not the arrays read (a list inside a tensor's innermost row, such as `[1, [2]]`,
which simdjson's flattening would hide; a repeated key's dropped array; a '[' inside a string).
"""

from __future__ import annotations

import math

import numpy as np

Path = tuple  # keys and list indices from the top object to the tensor, e.g. ("inputs", 0, "data")

MAX_DEPTH = 32  # objects and lists inside each other; far past any request's, far below json's recursion limit
SCAN_BYTES = 1 << 18  # the piece of a body each vector operation of _scan reads


def read_with_tensor(data: bytes, path: Path, max_number_chars: int) -> dict | None:
    """The JSON object `data` with the value at `path` as a float64 ndarray of its shape where it is
    a regular (possibly nested) list of numbers, else as json gives it (a repeated key keeps its
    last value); None where the standard parser must read `data`, which refuses numbers longer than
    `max_number_chars`."""
    try:
        import simdjson
    except ImportError:  # a build without the wheel: the standard parser does it all
        return None
    long_number, opens = _scan(data, max_number_chars)
    if long_number:
        return None
    parser = simdjson.Parser()  # one per body: a parser is not shared while its results are alive
    try:
        doc = parser.parse(data)
    except Exception:  # noqa: BLE001  any reason simdjson has: the standard parser gives the user's error
        return None
    try:
        if not isinstance(doc, simdjson.Object):
            return None
        value = _with_tensor(doc, path, simdjson)
    except _Unread:
        return None
    finally:
        del doc  # the proxies go before their parser
    arrays, depth = _arrays_and_depth(value)
    if depth > MAX_DEPTH or arrays != opens:
        return None
    return value


def _scan(data: bytes, max_number_chars: int) -> tuple[bool, int]:
    """Whether `data` may hold a number token longer than `max_number_chars` characters, and its '['
    count, in one pass of vector operations over 256 KiB pieces (buffers that stay in cache and are
    not mapped afresh for each body, which made whole-body temporaries cost more than the parse).

    Such a token's characters are all among - . / 0-9 except one e or E and one +, so it holds a run
    of at least max_number_chars // 2 of those, which covers (max_number_chars // 2 - 3) // 4 aligned
    4-byte words in a row; no float as any encoder writes it (at most 25 characters) does."""
    words = (max_number_chars // 2 - 3) // 4
    whole = len(data) // 4 * 4
    b = np.frombuffer(data, np.uint8)
    shifted, mask = np.empty(SCAN_BYTES + 4 * words, np.uint8), np.empty(SCAN_BYTES + 4 * words, bool)
    opens, long = int(np.count_nonzero(b[whole:] == ord("["))), False
    for start in range(0, whole, SCAN_BYTES):
        piece = b[start:min(start + SCAN_BYTES + 4 * words, whole)]  # overlapping: a run across pieces is seen whole
        n, own = len(piece), min(SCAN_BYTES, whole - start)
        d = np.subtract(piece, np.uint8(ord("-")), out=shifted[:n])
        opens += int(np.count_nonzero(np.equal(d[:own], ord("[") - ord("-"), out=mask[:own])))
        if not long:  # four of - . / 0-9 in one aligned word, `words` such words in a row
            long = _has_run(np.less(d, 13, out=mask[:n]).view(np.uint32) == 0x01010101, words)
    return long, opens


def _has_run(mask: np.ndarray, n: int) -> bool:
    """Whether `mask` holds n Trues in a row: each step ANDs the mask with itself shifted, doubling the
    run it stands for, so a few vector passes instead of a loop."""
    covered = 1
    while covered < n and mask.size:
        step = min(covered, n - covered)
        mask = mask[:-step] & mask[step:]
        covered += step
    return bool(mask.any())


def _arrays_and_depth(value) -> tuple[int, int]:
    """The lists in `value` (a tensor counted as the lists it was read from) and how deep containers
    nest in it, counted iteratively so that no nesting can exhaust the stack."""
    arrays, deepest, stack = 0, 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, np.ndarray):
            arrays += sum(math.prod(v.shape[:i]) for i in range(v.ndim))
            deepest = max(deepest, depth + v.ndim - 1)
        elif isinstance(v, (list, dict)):
            arrays += isinstance(v, list)
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                break
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return arrays, deepest


def _with_tensor(node, path: Path, sj):
    if not path:
        tensor = _tensor(node, sj)
        return _python(node, sj) if tensor is None else tensor
    key, rest = path[0], path[1:]
    if isinstance(key, str) and isinstance(node, sj.Object):
        keys = list(node.keys())
        # node[k] is a repeated key's first value (json keeps the last), and looks a key up only up to a NUL
        if len(set(keys)) < len(keys) or any("\x00" in k for k in keys):
            raise _Unread
        return {k: (_with_tensor(node[k], rest, sj) if k == key else _python(node[k], sj)) for k in keys}
    if isinstance(key, int) and isinstance(node, sj.Array):
        return [(_with_tensor(v, rest, sj) if i == key else _python(v, sj)) for i, v in enumerate(node)]
    return _python(node, sj)


class _Unread(Exception):
    """A body the standard parser must read."""


def _python(node, sj):
    """What json.loads gives for this part of the document (as_dict keeps a repeated key's last value)."""
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
    if not shape or len(shape) > MAX_DEPTH or isinstance(first, bool) or not isinstance(first, (int, float)):
        return None
    try:
        flat = np.frombuffer(node.as_buffer(of_type="d"), dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):  # a string, a bool or null among the numbers
        return None
    if flat.size != math.prod(shape) or not _regular(node, shape, sj):
        return None
    return flat.reshape(shape)


def _regular(node, shape: list[int], sj) -> bool:
    """Whether every list above the innermost rows has its shape's length (as_buffer flattens ragged
    lists too); a list inside an innermost row is caught by read_with_tensor's '[' count."""
    level = [node]
    for size in shape[:-1]:
        below = []
        for lst in level:
            if not isinstance(lst, sj.Array) or len(lst) != size:
                return False
            below.extend(lst)
        level = below
    return all(isinstance(lst, sj.Array) and len(lst) == shape[-1] for lst in level)
