"""A text batch run as sub-batches of like length, where that costs the engine less than padding.

A batch of texts is padded to its longest text, so one long text makes every short one beside it
run at its length. Sorting the batch's texts by length and cutting it into runs of like length pads
little, but each run costs the engine a fixed amount of its own. `LengthGroupedSession` cuts a batch
where the padding a cut saves is worth more than a run's fixed cost. That cost is measured, not
assumed (`RunCost`): on the session when it is loaded, then on every run it makes, so that where a
run costs more than it did alone (a server whose request path and clients share the cores, where
waking the engine's threads takes milliseconds) the session cuts less. The server and the
benchmarks run text through it; the optimizer turns it off (`RuntimeOptions.length_groups`), since
cuts that follow the timing would let a variant's score move with how busy the machine was.

Only a model that takes an attention mask is cut: its vector for a text does not depend on the
padding beside it, so the outputs are the batch's own (to float rounding). A graph that quantizes
activations with a scale taken over the whole batch at run time (ONNX Runtime's dynamic INT8) is not
cut, since there a text's vector does depend on the rows beside it and the answers would change
with the load; nor is a model whose outputs have a per-token axis (the pieces' outputs would not
join). An observed run's time counts at most OUTLIER times what the line predicts (a pause, a first
run at a new shape), and the fixed cost never falls below a quarter of the one measured at load, so
one slow run cannot make the session cut every text apart, nor stop it cutting for long. Where the
engine feeds a run at a length rounded up (OpenVINO: `length_multiple`), runs are cut and their
padded tokens counted at the lengths it feeds. A packed variant (runtime.packing) runs each batch
once, its texts already end to end in rows; its tokens are counted as its rows fed them."""

from __future__ import annotations

import threading
import time

import numpy as np

from optiserve.runtime.packing import packed_size
from optiserve.text_input import MASK, TextInput, run_length, text_lengths

CALIBRATION_SHAPES = ((1, 16), (2, 64))  # (texts, tokens): one run near the fixed cost, one of 8 times the tokens
CALIBRATION_RUNS = 1  # timed runs per shape after a first one (the runs that follow refine the fit)
CALIBRATION_WEIGHT = 4.0  # the loaded measure counts as this many runs, so that a few runs do not overturn it
DECAY = 0.98  # each run's weight in the fit falls by this much a run: the last fifty or so runs decide
OUTLIER = 10.0  # an observed run counts as at most this many times (and at least 1/this of) the predicted time:
# wide enough for a busy server, where a short run takes several times what it took alone
FLOOR = 0.25  # the fixed cost in tokens never falls below this share of the one measured at load


class RunCost:
    """A session's cost of one run, `fixed` + `per_token` × its padded tokens (seconds): a least-squares
    line through the runs it made, recent ones weighing most (`observe`), started from two measured
    shapes. `fixed_tokens` is the fixed cost in tokens: what a cut must save to pay off."""

    def __init__(self, points: list[tuple[int, float]]):
        self._lock = threading.Lock()
        self._sums = [0.0] * 5  # weighted: count, tokens, tokens², seconds, tokens × seconds
        self._line = (0.0, 0.0)  # (fixed, per_token), replaced whole
        self._floor = 0.0  # set once the loaded measure is fitted
        for tokens, seconds in points:
            self._add(tokens, seconds, CALIBRATION_WEIGHT)
        self._fit()
        self._floor = FLOOR * self.fixed_tokens if self.per_token > 0 else 0.0

    @property
    def fixed(self) -> float:
        return self._line[0]

    @property
    def per_token(self) -> float:
        return self._line[1]

    @property
    def fixed_tokens(self) -> float:
        """Infinite (nothing is cut) until the runs tell a per-token cost apart."""
        fixed, per_token = self._line
        if per_token <= 0:
            return float("inf")
        return max(fixed / per_token, self._floor)

    def observe(self, tokens: int, seconds: float) -> None:
        """A run of `tokens` padded tokens took `seconds`: the line moves toward it (an outlier counts
        as OUTLIER times the predicted time at most)."""
        with self._lock:
            fixed, per_token = self._line
            if per_token > 0:
                predicted = fixed + per_token * tokens
                seconds = min(max(seconds, predicted / OUTLIER), predicted * OUTLIER)
            self._sums = [DECAY * v for v in self._sums]
            self._add(tokens, seconds, 1.0)
            self._fit()

    def _add(self, tokens: float, seconds: float, weight: float) -> None:
        for i, v in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            self._sums[i] += weight * v

    def _fit(self) -> None:
        """The weighted line; kept as it was where the runs cannot tell a fixed cost from a per-token one."""
        n, x, xx, y, xy = self._sums
        spread = n * xx - x * x
        if spread <= 1e-12 * max(n * xx, 1.0):
            return
        per_token = (n * xy - x * y) / spread
        if per_token <= 0:
            return
        self._line = (max((y - per_token * x) / n, 0.0), per_token)

    @classmethod
    def measure(cls, run, max_length: int) -> "RunCost | None":
        """`run` (a session's run_outputs) timed at CALIBRATION_SHAPES (lengths capped at `max_length`,
        and kept apart so that the outputs' shapes at two lengths can be compared); None where the
        model's outputs change shape with the sequence length (per-token outputs), or where the model
        is too short to tell. Where the two shapes cannot tell a fixed cost from a per-token one (a
        model so small that noise hides its per-token cost), nothing is cut until the runs that
        follow do."""
        (short_texts, short), (long_texts, long) = CALIBRATION_SHAPES
        long = min(long, max_length)
        short = min(short, long // 2)
        if short < 1:
            return None
        points, shapes = [], []
        for texts, length in ((short_texts, short), (long_texts, long)):
            batch = np.zeros((texts, 3, length), dtype=np.int64)  # token id 0, every token real
            batch[:, MASK] = 1
            shapes.append([o.shape[1:] for o in run(batch)])
            best = float("inf")
            for _ in range(CALIBRATION_RUNS):
                t0 = time.perf_counter()
                run(batch)
                best = min(best, time.perf_counter() - t0)
            points.append((texts * length, best))
        if shapes[0] != shapes[1]:
            return None
        return cls(points)


def length_groups(lengths: np.ndarray, fixed_tokens: float) -> list[np.ndarray]:
    """The rows of a batch (their token `lengths`) cut into runs of like length that cost the least
    in padded tokens plus `fixed_tokens` a run: row indices, each run's in ascending length. One run
    (every row, in its order) where no cut can pay off. Cuts fall only between different lengths,
    so the search is over the batch's distinct lengths (at most the model's max length)."""
    lengths = np.asarray(lengths)
    n = len(lengths)
    if n < 2 or n * int(lengths.max()) - int(lengths.sum()) <= fixed_tokens:  # all the padding is worth less than a run
        return [np.arange(n)]
    order = np.argsort(lengths, kind="stable")
    distinct, counts = np.unique(lengths[order], return_counts=True)
    rows_before = np.concatenate([[0], np.cumsum(counts)])  # rows shorter than each distinct length
    d = len(distinct)
    # best[j]: the least cost of the rows of the j shortest lengths; a run of lengths i..j-1 costs
    # fixed + its rows × the longest of them
    best = np.zeros(d + 1)
    start = np.zeros(d + 1, dtype=np.int64)
    for j in range(1, d + 1):
        costs = best[:j] + fixed_tokens + (rows_before[j] - rows_before[:j]) * float(distinct[j - 1])
        start[j] = int(np.argmin(costs))
        best[j] = costs[start[j]]
    runs, j = [], d
    while j > 0:
        runs.append(order[rows_before[start[j]]:rows_before[j]])
        j = start[j]
    return runs[::-1] if len(runs) > 1 else [np.arange(n)]


class LengthGroupedSession:
    """A text model's session that runs each batch as `length_groups` cuts it (see the module's
    docstring); everything else is the wrapped session's."""

    def __init__(self, session, text: TextInput, enabled: bool = True):
        self.session = session
        per_batch = getattr(session, "quantizes_activations_per_batch", None)  # a backend that can say so
        self.packed = getattr(session, "packing", None) is not None  # one run a batch, its texts in rows
        cuttable = enabled and not self.packed and "attention_mask" in text.inputs and \
            not (per_batch is not None and per_batch())
        self.cost = RunCost.measure(session.run_outputs, text.max_length) if cuttable else None
        # an engine that feeds runs at lengths rounded up (openvino_backend) is costed at those lengths
        self.multiple, self.max_length = int(getattr(session, "length_multiple", 1)), text.max_length
        self._ran = threading.local()  # per thread: (the last batch run, the tokens its runs padded to)

    def __getattr__(self, name):  # backend, device, computes_in and a backend's own attributes
        if name == "session":
            raise AttributeError(name)
        return getattr(self.session, name)

    def run_cost(self) -> dict | None:
        """The cost of a run as it stands (None where batches are never cut): what /stats reports."""
        if self.cost is None:
            return None
        fixed_tokens = self.cost.fixed_tokens
        return {"fixed_ms": round(1e3 * self.cost.fixed, 4), "per_token_ms": round(1e3 * self.cost.per_token, 6),
                "fixed_tokens": round(fixed_tokens, 1) if fixed_tokens != float("inf") else None}

    def groups(self, batch: np.ndarray) -> list[np.ndarray]:
        """The runs `batch` would be cut into now (row indices); one run where nothing is cut."""
        return [rows for rows, _ in self._runs(batch)] if len(batch) else [np.arange(0)]

    def _runs(self, batch: np.ndarray) -> list[tuple[np.ndarray, int]]:
        """Each run `batch` (not empty) would be cut into now: its rows and its longest row's tokens."""
        lengths = run_length(text_lengths(batch), self.multiple, self.max_length)  # as the engine is fed them
        cut = [np.arange(len(batch))] if self.cost is None or len(batch) < 2 else \
            length_groups(lengths, self.cost.fixed_tokens)
        return [(rows, int(lengths[rows].max())) for rows in cut]

    def padded_tokens(self, batch: np.ndarray) -> int:
        """The tokens the engine ran for `batch`, each run's rows × its longest row (a packed
        variant's rows × their length): as this thread last ran it, else as it would run it now."""
        last = getattr(self._ran, "last", None)
        if last is not None and last[0] is batch:
            return last[1]
        if len(batch) == 0:
            return 0
        if self.packed:
            return packed_size(text_lengths(batch), self.session.packing.row_tokens)
        return sum(len(rows) * longest for rows, longest in self._runs(batch))

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self._grouped(batch, lambda b: [self.session.run(b)])[0]

    def run_outputs(self, batch: np.ndarray) -> list[np.ndarray]:
        return self._grouped(batch, self.session.run_outputs)

    def _grouped(self, batch: np.ndarray, run) -> list[np.ndarray]:
        """`run`'s outputs for `batch`, run in its groups and joined back in the batch's row order;
        each run's time taught to the cost."""
        if len(batch) == 0:
            return run(batch)
        runs = self._runs(batch)
        pieces = []
        for rows, longest in runs:
            t0 = time.perf_counter()
            pieces.append(run(batch if len(runs) == 1 else batch[rows, :, :longest]))
            if self.cost is not None:
                self.cost.observe(len(rows) * longest, time.perf_counter() - t0)
        self._ran.last = (batch, self.session.tokens_fed if self.packed else
                          sum(len(rows) * longest for rows, longest in runs))
        if len(runs) == 1:
            return pieces[0]
        joined = []
        for k, first in enumerate(pieces[0]):
            out = np.empty((len(batch), *first.shape[1:]), dtype=first.dtype)
            for (rows, _), piece in zip(runs, pieces):
                out[rows] = piece[k]
            joined.append(out)
        return joined
