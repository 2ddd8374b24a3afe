"""Texts for the load generator: a user's text file (`--texts text:FILE`, read as `optimize --dataset
text:` reads a file), cut into requests of N texts in the file's order, cycling, with the tokens each
request's texts keep under the served model's own tokenizer where that tokenizer is at hand."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from optiserve.data.text import read_text_file
from optiserve.errors import UserError
from optiserve.files import sha256_of

PREFIX = "text:"
MAX_TEXTS = 10_000  # the file's first texts sent; enough that a run's requests do not repeat a few
ENCODE_CHUNK = 1000  # texts tokenized per call when counting: a batch is padded to its longest text


@dataclass(frozen=True)
class TextLoad:
    """What a text load sends: `requests` in turn (request k is `requests[k % len]`), each a list of
    texts, and the tokens each one's texts keep (`tokens`, special tokens included; None where no
    tokenizer was given)."""

    source: str
    requests: list[list[str]]
    tokens: list[int] | None = None

    @property
    def per_request(self) -> int:
        return len(self.requests[0])

    def __len__(self) -> int:
        return len(self.requests)

    def settings(self) -> dict:
        """What a results file or tune.json keeps of the load: its file, and a digest of the texts it
        sends, so that a resumed tune can tell the same file from one changed since."""
        return {"texts": self.source, "texts_per_request": self.per_request, "tokens_counted": self.tokens is not None,
                "sha256": sha256_of(text.encode("utf-8", "surrogatepass") for r in self.requests for text in r)}


def text_path(spec: str) -> Path:
    """The file `text:FILE` names; a spec without the prefix, or a folder, is one line naming the fix."""
    if not spec.startswith(PREFIX) or not spec[len(PREFIX):]:
        raise UserError(f"--texts {spec}: give text:FILE, a .txt file (one text a line) or a .tsv/.csv with a "
                        f"`text` column, as optimize --dataset text: reads it")
    path = Path(spec[len(PREFIX):]).expanduser()
    if path.is_dir():
        raise UserError(f"--texts {spec}: a folder; give one file, text:FILE.txt|.tsv|.csv")
    return path


def read_texts(spec: str) -> list[str]:
    """The texts of `text:FILE` in the file's order: a .txt file's lines (a fastText label dropped), a
    .tsv/.csv's `text` column, or a pairs file's `text1` and `text2` of each row in turn."""
    file = read_text_file(text_path(spec))
    texts = file.texts if file.second is None else [t for pair in zip(file.texts, file.second) for t in pair]
    return texts[:MAX_TEXTS]


def text_load(spec: str, per_request: int = 1, tokenizer: Path | None = None,
              max_length: int | None = None) -> TextLoad:
    """`spec`'s texts as requests of `per_request` texts each: request k holds texts k*N .. k*N+N-1
    of the file, cycling, and there are as many requests as it takes for the order to come round
    again. With `tokenizer` (a tokenizer.json) and the model's `max_length`, each request's tokens
    are counted as the server counts them (truncated at max_length, special tokens included)."""
    if per_request < 1:
        raise UserError(f"--texts-per-request {per_request}: one or more texts a request")
    texts = read_texts(spec)
    count = len(texts) // math.gcd(len(texts), per_request)
    at = [[(k * per_request + i) % len(texts) for i in range(per_request)] for k in range(count)]
    tokens = None
    if tokenizer is not None:
        from optiserve.text_input import TextTokenizer

        encoder = TextTokenizer(tokenizer, max_length)
        lengths = [int(n) for start in range(0, len(texts), ENCODE_CHUNK)
                   for n in encoder.encode(texts[start:start + ENCODE_CHUNK]).lengths]
        tokens = [sum(lengths[i] for i in request) for request in at]
    return TextLoad(spec, [[texts[i] for i in request] for request in at], tokens)
