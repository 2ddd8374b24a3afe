"""Training batches of texts of about one length: Lee's background news (documents and their
sentences, as gensim's wheel carries them) tokenized by all-MiniLM-L6-v2's own tokenizer, batched
as distillation batches them."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import minilm_folder
from optiserve.data.length_grouped import LengthGroupedSampler, token_lengths
from optiserve.text_input import TextTokenizer

BATCH = 32


@pytest.fixture(scope="module")
def rows() -> TensorDataset:
    pytest.importorskip("gensim", reason="gensim's bundled corpora are the real texts these tests read ([dev])")
    from gensim.test.utils import datapath

    docs = [line.strip() for line in Path(datapath("lee_background.cor")).read_bytes().decode("latin-1").splitlines()
            if line.strip()]
    sentences = [s for d in docs for s in re.split(r"(?<=[.!?])\s+", d) if len(s.split()) >= 5]
    tokens = TextTokenizer(minilm_folder() / "tokenizer.json", 256).encode(docs + sentences)
    return TensorDataset(torch.from_numpy(tokens.batch), torch.zeros(len(docs) + len(sentences)))


def padded_tokens(dataset: TensorDataset, sampler) -> int:
    """Tokens the batches run, each padded to its longest row (as a text model trims them)."""
    lengths = token_lengths(dataset)
    loader = DataLoader(range(len(dataset)), batch_size=BATCH, sampler=sampler, drop_last=True)
    return sum(len(batch) * int(lengths[batch.numpy()].max()) for batch in loader)


def test_batches_of_one_length_pad_a_fraction_of_what_random_batches_pad_and_see_every_row_once(rows):
    lengths = token_lengths(rows)
    assert np.array_equal(lengths, rows.tensors[0][:, 1].sum(1).numpy()) and lengths.max() == 256
    grouped = LengthGroupedSampler(lengths, BATCH, torch.Generator().manual_seed(0))
    order = list(grouped)
    assert sorted(order) == list(range(len(rows)))  # every row once an epoch
    full = len(rows) // BATCH * BATCH
    assert len(set(order[:full])) == full and all(len(rows) > i >= 0 for i in order)
    # a short last batch, if any, comes last: drop_last drops only it
    random = torch.utils.data.RandomSampler(rows, generator=torch.Generator().manual_seed(0))
    assert padded_tokens(rows, grouped) < padded_tokens(rows, random) / 3


def test_the_order_is_random_but_seeded(rows):
    lengths = token_lengths(rows)
    first, again, other = (list(LengthGroupedSampler(lengths, BATCH, torch.Generator().manual_seed(s)))
                           for s in (0, 0, 1))
    assert first == again and first != other


def test_images_and_float_rows_are_not_token_rows():
    assert token_lengths(TensorDataset(torch.zeros(4, 3, 8, 8))) is None
    assert token_lengths(TensorDataset(torch.zeros(4, 3, 8))) is None  # floats
    assert token_lengths(range(4)) is None
