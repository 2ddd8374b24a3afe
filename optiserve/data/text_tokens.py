"""A text dataset (data/text.py) made into what a text model takes: each role's texts tokenized by
the model's own tokenizer (optiserve.text_input) into token batches [N, 3, L], with the labels where
the texts have them. The three roles stay as they were split: train fits, validation chooses, test
reports. Scored pairs are embedded one text at a time: a role's rows are its pairs' first texts,
then their second texts, each row labelled with its pair's score (truth "pairs"). Texts with sets of
classes (`a|b`) are labelled [C] in {0, 1} over the dataset's classes (truth "class-sets")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from optiserve.data.splits import DatasetSplits
from optiserve.data.text import TextExamples, load_text_splits
from optiserve.errors import UserError
from optiserve.text_input import TextInput, TextTokenizer


TRUTHS = {"pairs": "pairs", "multilabelled": "class-sets"}  # what a role's labels are, by the file's kind


def load_text_dataset(name: str, model_input: TextInput, folder: Path, seed: int = 0) -> DatasetSplits:
    """`--dataset text:PATH` for a text model whose tokenizer is in `folder`."""
    path = name.split(":", 1)[1]
    if not path:
        raise UserError("text needs a path: --dataset text:FILE.txt|.tsv|.csv or text:FOLDER")
    splits = load_text_splits(path, seed=seed)
    tokenizer = TextTokenizer(folder / model_input.tokenizer, model_input.max_length)
    labelled = splits.kind in ("labelled", "multilabelled", "pairs")
    roles = [_tokenized(examples, tokenizer, splits.kind, len(splits.classes))
             for examples in (splits.train, splits.val, splits.test)]
    truncated = sum(n for _, n in roles)
    note = splits.how
    if truncated:
        note += (f"; {truncated} texts were longer than the model's {model_input.max_length} tokens and were "
                 f"truncated, as the model's own tokenizer does")
    return DatasetSplits(splits.name, *(dataset for dataset, _ in roles), splits.classes, model_input,
                         labelled=labelled, split_note=note, truth=TRUTHS.get(splits.kind, "classes"),
                         val_texts=list(splits.val.texts) + list(splits.val.second or []))


def rows_of_length(texts: list[str], model_input: TextInput, folder: Path, length: int, rows: int) -> np.ndarray:
    """A token batch [rows, 3, length] in which every row is exactly `length` real tokens (special
    tokens included, no padding), to time a text model at that length on real text: row i is texts
    i, i+1, ... joined by spaces (cycling through them where they are short), tokenized by the
    model's own tokenizer and truncated at `length`, as a longer text sent to the server is."""
    tokenizer = TextTokenizer(folder / model_input.tokenizer, length)
    special = tokenizer.tokenizer.num_special_tokens_to_add(False)
    if length <= special:
        raise UserError(f"a sequence length of {length} tokens leaves no room for text beside the model's {special} "
                        f"special tokens; time at {special + 1} tokens or more")
    counts = [len(e.ids) for e in tokenizer.tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    if not sum(counts):
        raise UserError("the validation texts hold no tokens to build timing rows from")
    joined = []
    for i in range(rows):
        parts, have, j = [], 0, i
        while have < length:  # a margin past `length - special`: joining may merge a token or two
            parts.append(texts[j % len(texts)])
            have += counts[j % len(texts)]
            j += 1
        joined.append(" ".join(parts))
    batch = tokenizer.encode(joined).batch
    short = int((batch[:, 1].sum(axis=1) < length).sum())
    if short or batch.shape[2] != length:
        raise RuntimeError(f"{short} of {rows} timing rows came out shorter than {length} tokens")
    return batch


def _tokenized(examples: TextExamples, tokenizer: TextTokenizer, kind: str,
               classes: int) -> tuple[TensorDataset, int]:
    texts = list(examples.texts) + list(examples.second or [])
    tokens = tokenizer.encode(texts)
    if kind == "pairs" and examples.scores is not None:  # unlabelled training texts beside pairs: no scores
        labels = torch.from_numpy(np.concatenate([examples.scores, examples.scores]).astype(np.float64))
    elif kind == "multilabelled":
        labels = torch.zeros((len(texts), classes), dtype=torch.int64)
        for row, names in enumerate(examples.labels):
            labels[row, names] = 1
    else:
        labels = torch.from_numpy(np.asarray(examples.labels if kind == "labelled" else [0] * len(texts), np.int64))
    return TensorDataset(torch.from_numpy(tokens.batch), labels), tokens.truncated
