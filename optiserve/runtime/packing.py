"""Sequence packing: a batch of texts laid end to end in a few rows, for a packed encoder graph.

A server batches texts as they arrive, so a batch mixes lengths; padded to its longest, most of a
batch of sentences is padding, and cutting it into runs by length (runtime.length_groups) pays each
run's fixed cost. A packed graph takes rows of several texts instead: its inputs are the tokens'
ids (and token types) with, per token, its position within its own text and its text's number in
the row (`segment_ids`, -1 on padding); each token attends only to its own text's tokens (the graph
builds the block-diagonal mask from the segment numbers), so each text gets the vector it gets
alone. Its output is per token; each text's vector is pooled here, as sentence-transformers pools
(the pooling modes and normalisation the model folder declares, stored in the variant's settings).

Rows are filled first fit, longest text first, up to `row_tokens` (or the batch's longest text
where that is longer), and all rows of a run are padded to the longest row rounded up to
ROW_MULTIPLE: few distinct shapes for OpenVINO to compile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from optiserve.errors import UserError
from optiserve.text_input import IDS, POOLING_MODES, TYPES, text_lengths

# a packed graph's inputs, in order; a model without token types takes the first three
PACKED_INPUTS = ("input_ids", "position_ids", "segment_ids", "token_type_ids")
ROW_MULTIPLE = 8


@dataclass(frozen=True)
class Packing:
    """A packed variant's settings: rows' length in tokens, and the pooling the folder declares."""

    row_tokens: int
    pooling: tuple[str, ...]
    normalize: bool

    def to_dict(self) -> dict:
        return {"row_tokens": self.row_tokens, "pooling": list(self.pooling), "normalize": self.normalize}

    @classmethod
    def from_dict(cls, entry: dict) -> Packing:
        pooling = tuple(entry["pooling"])
        if not pooling or any(mode not in POOLING_MODES for mode in pooling):
            raise ValueError(f"packed pooling {', '.join(pooling) or 'none'}; packing pools {', '.join(POOLING_MODES)}")
        return cls(int(entry["row_tokens"]), pooling, bool(entry["normalize"]))


def packing_of(variant: dict) -> Packing | None:
    """A variant's packing settings (`settings.packing`), or None for a variant fed padded batches."""
    entry = (variant.get("settings") or {}).get("packing")
    if entry is None:
        return None
    try:
        return Packing.from_dict(entry)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"variant {variant['name']!r}: its packing settings cannot be read ({e})") from None


def packed_graph_inputs(names: list[str], variant: dict, graph: str) -> list[str]:
    """A packed graph's inputs `names`, as `pack` feeds them; a graph that takes another is a
    packed variant that cannot run, said in one line when it loads rather than on every batch."""
    if unknown := [name for name in names if name not in PACKED_INPUTS]:
        raise UserError(f"variant {variant['name']!r}: {graph} takes {', '.join(unknown)}, which packed rows do "
                        f"not hold (they feed {', '.join(PACKED_INPUTS)})")
    return names


@dataclass
class PackedRows:
    """A token batch as packed rows: the graph's inputs (PACKED_INPUTS, each int64 [rows, length]; a
    graph without token types is fed the others) and where each text lies (row, start, tokens), in
    the batch's order."""

    feeds: dict[str, np.ndarray]
    where: list[tuple[int, int, int]]

    @property
    def tokens_fed(self) -> int:
        return int(self.feeds["input_ids"].size)


def first_fit(lengths, row_tokens: int) -> tuple[list[list[int]], list[int]]:
    """The rows texts of these lengths are laid in (each row its texts' indices) and each row's tokens:
    first fit, longest text first (ties in their order), up to `row_tokens` or the longest text. On
    plain ints: the server's token budget asks this for every row a batch takes, on the event loop,
    where numpy's per-call cost on a few numbers would be most of it."""
    lengths = [int(n) for n in lengths]
    limit = max(row_tokens, max(lengths, default=1))
    rows: list[list[int]] = []
    filled: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):  # stable: ties keep their order
        n = lengths[i]
        for r, used in enumerate(filled):
            if used + n <= limit:
                rows[r].append(i)
                filled[r] = used + n
                break
        else:
            rows.append([i])
            filled.append(n)
    return rows, filled


def _row_length(filled: list[int]) -> int:
    return -(-max(filled, default=1) // ROW_MULTIPLE) * ROW_MULTIPLE


def packed_size(lengths: list[int], row_tokens: int) -> int:
    """The tokens a packed run of texts of these lengths feeds (its rows × their length): what a
    server's token budget counts for a packed variant."""
    rows, filled = first_fit(lengths, row_tokens)
    return len(rows) * _row_length(filled)


def pack(batch: np.ndarray, row_tokens: int) -> PackedRows:
    """Lay the texts of a token batch [N, 3, L] end to end in rows (see the module's docstring); each
    text's tokens are the first of its row, padding after them, as `TextInput` makes every batch."""
    lengths = np.asarray(text_lengths(batch), dtype=int)
    rows, filled = first_fit(lengths, row_tokens)
    shape = (len(rows), _row_length(filled))
    ids, types, positions = np.zeros(shape, np.int64), np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    segments = np.full(shape, -1, np.int64)
    where: list = [None] * len(batch)
    for r, members in enumerate(rows):
        at = 0
        for s, i in enumerate(members):
            n = int(lengths[i])
            ids[r, at:at + n], types[r, at:at + n] = batch[i, IDS, :n], batch[i, TYPES, :n]
            positions[r, at:at + n], segments[r, at:at + n] = np.arange(n), s
            where[i] = (r, at, n)
            at += n
    return PackedRows(dict(zip(PACKED_INPUTS, (ids, positions, segments, types))), where)


def run_packed(batch: np.ndarray, packing: Packing, names: list[str], infer) -> tuple[np.ndarray, PackedRows]:
    """Each text's vector [N, width] for a token batch, from one run of a packed graph: `infer` takes
    the rows' inputs `names` (the graph's, by name) and returns its per-token output; also the rows fed."""
    rows = pack(batch, packing.row_tokens)
    hidden = infer({name: rows.feeds[name] for name in names})
    return pooled(hidden, rows.where, packing), rows


def pooled(hidden: np.ndarray, where: list[tuple[int, int, int]], packing: Packing) -> np.ndarray:
    """Each text's vector [N, width] from the rows' token vectors [rows, length, D]."""
    out = np.empty((len(where), len(packing.pooling) * hidden.shape[-1]), np.float32)
    for k, (r, start, n) in enumerate(where):
        tokens = hidden[r, start:start + n]
        out[k] = np.concatenate([_pool(mode, tokens) for mode in packing.pooling])
    if packing.normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


def _pool(mode: str, tokens: np.ndarray) -> np.ndarray:
    if mode == "cls":
        return tokens[0]
    if mode == "max":
        return tokens.max(axis=0)
    total = tokens.sum(axis=0, dtype=np.float32)
    return total / (len(tokens) if mode == "mean" else np.sqrt(len(tokens)))
