"""What a text model takes, and texts made into it. A small shared module (numpy and `tokenizers`,
no torch): the optimizer, the runtime and the server tokenize through the same `TextInput`, so the
tokens a variant was judged on are the tokens it is served.

A batch of texts becomes one int64 array [N, 3, L]: per text its token ids, its attention mask and
its token type ids, padded to the batch's longest text (L), never to the model's maximum. One array
lets every layer that slices, concatenates and batches rows of images do the same with texts; the
runtime hands the graph its named inputs from it (`TextInput.feeds`). The tokenizer itself is
`tokenizers`' Rust one (`encode_batch_fast`: no Python loop over the texts, and no character
offsets, which nothing here reads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # the rows of a token batch, in order
# the sentence-transformers pooling modes a model folder is built with, and a packed variant pools
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens")
# a text to warm up and time a text model on where no user text is at hand (the server, bench engine)
SAMPLE_TEXT = "A short sentence, about as long as the ones a search box or a chat message sends."
IDS, MASK, TYPES = range(3)


@dataclass(frozen=True)
class TextInput:
    """A text model's input: its tokenizer (`tokenizer`, a `tokenizer.json` file name in the model's
    folder), the most tokens a text keeps (`max_length`; longer texts are truncated), and which of
    TOKEN_INPUTS its graph takes (`inputs`, in the graph's own names and order)."""

    tokenizer: str
    max_length: int
    inputs: tuple[str, ...] = TOKEN_INPUTS

    def __post_init__(self):
        if self.max_length < 2:
            raise ValueError(f"a text model's max_length must be at least 2, got {self.max_length}")
        unknown = set(self.inputs) - set(TOKEN_INPUTS)
        if unknown or "input_ids" not in self.inputs:
            raise ValueError(f"a text model's inputs are input_ids and optionally attention_mask and "
                             f"token_type_ids, got {', '.join(self.inputs)}")

    def to_dict(self) -> dict:
        """The manifest's `input` of a text model (`kind` tells it from an image model's)."""
        return {"kind": "text", "tokenizer": self.tokenizer, "max_length": self.max_length, "inputs": list(self.inputs)}

    @classmethod
    def from_dict(cls, entry: dict) -> TextInput:
        return cls(entry["tokenizer"], int(entry["max_length"]), tuple(entry.get("inputs") or TOKEN_INPUTS))

    def feeds(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """A token batch [N, 3, L] as the graph's named inputs, each int64 [N, L]."""
        return {name: np.ascontiguousarray(tokens[:, TOKEN_INPUTS.index(name)]) for name in self.inputs}


@dataclass
class Tokens:
    """Texts as a model takes them: `batch` int64 [N, 3, L] (see the module's docstring), how many
    tokens each text kept (`lengths`, special tokens included) and how many texts lost tokens to
    `max_length` (`truncated`)."""

    batch: np.ndarray
    lengths: np.ndarray
    truncated: int


class TextTokenizer:
    """A model's tokenizer (`tokenizer.json`, read by `tokenizers`), truncating at `max_length`
    and padding each batch to its longest text."""

    def __init__(self, path: Path | str, max_length: int):
        from optiserve.errors import UserError, first_line

        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("text models need tokenizers: pip install 'optiserve[text]'") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001  tokenizers raises a bare Exception on a file it cannot parse
            raise UserError(f"{path} is not a tokenizer file `tokenizers` can read "
                            f"({first_line(e, limit=200)}): save the model's fast tokenizer there") from None
        self.pad_id = _pad_id(self.tokenizer)  # read before padding is turned off, which forgets its pad id
        self.tokenizer.no_padding()
        # truncated before the special tokens are added, as the model's own tokenizer does; what a
        # text lost is in its encoding's `overflowing`, so that truncated texts are counted
        self.tokenizer.enable_truncation(max_length)
        self.max_length = max_length

    def encode(self, texts: list[str]) -> Tokens:
        """Tokenize `texts` in one batched call; the batch padded to its longest text."""
        if not texts:
            raise ValueError("no texts to tokenize")
        encodings = self.tokenizer.encode_batch_fast(list(texts))
        truncated = sum(1 for e in encodings if e.overflowing)
        lengths = [len(e.ids) for e in encodings]
        return Tokens(token_batch(encodings, self.pad_id, lengths), np.array(lengths, dtype=np.int64), truncated)


def token_batch(encodings: list, pad_id: int, lengths: list[int] | None = None) -> np.ndarray:
    """`tokenizers` encodings as one token batch [N, 3, L], padded with `pad_id` (mask 0) to the longest.
    `lengths`: each encoding's tokens, where the caller has counted them (each `.ids` is a new list)."""
    lengths = [len(e.ids) for e in encodings] if lengths is None else lengths
    width = max(lengths)
    if min(lengths) == width:  # nothing to pad (one text a request, most often)
        return np.array([(e.ids, e.attention_mask, e.type_ids) for e in encodings], dtype=np.int64)
    batch = np.zeros((len(encodings), 3, width), dtype=np.int64)
    batch[:, IDS] = pad_id
    for row, encoding, n in zip(batch, encodings, lengths):
        row[IDS, :n] = encoding.ids
        row[MASK, :n] = encoding.attention_mask
        row[TYPES, :n] = encoding.type_ids
    return batch


def _pad_id(tokenizer) -> int:
    """The id the tokenizer pads with: its padding setting's, else its [PAD] / <pad> token, else 0."""
    padding = tokenizer.padding
    if padding and padding.get("pad_id") is not None:
        return int(padding["pad_id"])
    for token in ("[PAD]", "<pad>"):
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    return 0


def run_length(longest, multiple: int, max_length: int):
    """The length a run whose longest text has `longest` tokens (an int, or an array of them) is fed
    to an engine at: rounded up to a multiple of `multiple` (an engine that compiles for each new
    shape meets fewer of them), never past `max_length` nor below `longest`."""
    return np.maximum(longest, np.minimum(-(-longest // multiple) * multiple, max_length))


def to_length(tokens: np.ndarray, length: int) -> np.ndarray:
    """A token batch cut to `length` tokens, or padded to it with masked columns (id 0, mask 0, type
    0): tokens no text attends to, so that a model taking an attention mask gives each text the
    vector it gets at its own length."""
    width = tokens.shape[-1]
    if length <= width:
        return tokens[..., :length]
    out = np.zeros((*tokens.shape[:-1], length), dtype=tokens.dtype)
    out[..., :width] = tokens
    return out


def text_lengths(tokens: np.ndarray) -> np.ndarray:
    """Each text's own tokens in a token batch: its mask's ones (special tokens in, padding out), at least 1."""
    return np.maximum(np.count_nonzero(tokens[:, MASK], axis=1), 1)


def trim_padding(tokens: np.ndarray) -> np.ndarray:
    """A token batch cut to its longest text: rows taken from a batch padded further (a dataset's
    texts, padded to the longest of them all) are run at their own length."""
    return tokens[:, :, :int(text_lengths(tokens).max()) if len(tokens) else 1]


def text_input_of(manifest: dict) -> TextInput | None:
    """A text model's input as its manifest records it; None for a model that takes images."""
    given = manifest.get("input") or {}
    return TextInput.from_dict(given) if given.get("kind") == "text" else None
