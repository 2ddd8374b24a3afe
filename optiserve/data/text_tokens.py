"""A text dataset (data/text.py) made into what a text model takes: each role's texts tokenized by
the model's own tokenizer (optiserve.text_input) into token batches [N, 3, L], with the labels where
the texts have them. The three roles stay as they were split: train fits, validation chooses, test
reports. Scored pairs are embedded one text at a time: a role's rows are its pairs' first texts,
then their second texts, each row labelled with its pair's score (truth "pairs")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from optiserve.data.splits import DatasetSplits
from optiserve.data.text import TextExamples, load_text_splits
from optiserve.errors import UserError
from optiserve.text_input import TextInput, TextTokenizer


def load_text_dataset(name: str, model_input: TextInput, folder: Path, seed: int = 0) -> DatasetSplits:
    """`--dataset text:PATH` for a text model whose tokenizer is in `folder`."""
    path = name.split(":", 1)[1]
    if not path:
        raise UserError("text needs a path: --dataset text:FILE.txt|.tsv|.csv or text:FOLDER")
    splits = load_text_splits(path, seed=seed)
    tokenizer = TextTokenizer(folder / model_input.tokenizer, model_input.max_length)
    labelled = splits.kind in ("labelled", "pairs")
    roles = [_tokenized(examples, tokenizer, splits.kind) for examples in (splits.train, splits.val, splits.test)]
    truncated = sum(n for _, n in roles)
    note = splits.how
    if truncated:
        note += (f"; {truncated} texts were longer than the model's {model_input.max_length} tokens and were "
                 f"truncated, as the model's own tokenizer does")
    return DatasetSplits(splits.name, *(dataset for dataset, _ in roles), splits.classes, model_input,
                         labelled=labelled, split_note=note, truth="pairs" if splits.kind == "pairs" else "classes")


def _tokenized(examples: TextExamples, tokenizer: TextTokenizer, kind: str) -> tuple[TensorDataset, int]:
    texts = list(examples.texts) + list(examples.second or [])
    tokens = tokenizer.encode(texts)
    if kind == "pairs":
        labels = torch.from_numpy(np.concatenate([examples.scores, examples.scores]).astype(np.float64))
    else:
        labels = torch.from_numpy(np.asarray(examples.labels if kind == "labelled" else [0] * len(texts), np.int64))
    return TensorDataset(torch.from_numpy(tokens.batch), labels), tokens.truncated
