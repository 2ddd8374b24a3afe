"""Texts to time a text model on: drawn from the file of texts its service will see, so that its
timing reflects their lengths rather than the validation texts'. Torch-free: `bench engine` draws
them as `optimize --timing-texts` does."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from optiserve.data.text import read_text_file
from optiserve.text_input import TextInput, TextTokenizer


def timing_sample(path: str | Path, model_input: TextInput, folder: Path, rows: int,
                  seed: int = 0) -> tuple[np.ndarray, dict]:
    """A token batch [rows, 3, L] of texts drawn from `path` (any text dataset file: its texts, both
    of a pair's; labels and scores unread), to time a text model on the lengths its service will
    see rather than the validation texts': `rows` texts drawn without replacement (seeded; every
    text, cycled, where the file holds fewer), tokenized by the model's own tokenizer, padded to the
    longest, the drawn text of median length first (what batch 1 times: one text drawn at random
    could be the file's one long outlier). Timing decides nothing about accuracy, so the texts may
    come from anywhere, traffic included. Also what was drawn: the file, its texts, and the drawn
    texts' tokens."""
    file = read_text_file(path)
    texts = list(file.texts) + list(file.second or [])
    picked = np.random.default_rng(seed).permutation(len(texts))[:rows]
    drawn = [texts[i] for i in np.resize(picked, rows)]
    tokens = TextTokenizer(folder / model_input.tokenizer, model_input.max_length).encode(drawn)
    by_length = np.argsort(tokens.lengths, kind="stable")
    median = by_length[(len(by_length) - 1) // 2]
    order = [median, *(i for i in range(rows) if i != median)]
    facts = {"file": str(path), "texts": len(texts), "drawn": rows, "distinct": len(picked),
             "tokens_mean": round(float(tokens.lengths.mean()), 1), "tokens_max": int(tokens.lengths.max()),
             "truncated": tokens.truncated}
    return tokens.batch[order], facts
