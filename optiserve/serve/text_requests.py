"""A text model's side of serving: its tokenizer loaded once, the texts a request sends checked and
tokenized (one `encode_batch_fast` call), token rows of different lengths joined into one batch, and the
token batches it is warmed up and timed with. Every transport reads texts through here, so /predict,
the protocol's BYTES tensors and /v1/embeddings refuse the same things with the same words. Where
a request's parsers run (the event loop for a small body, the decode threads beyond) is
Server.decode_texts' choice."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from optiserve.runtime import get_backend
from optiserve.runtime.variants import LoadedVariant, warm_up_on
from optiserve.serve import binary
from optiserve.serve.binary import BinaryFormatError, split_body
from optiserve.serve.envelope import (InferRequest, TooManyImages, id_field, name_field, object_field, parse_json,
                                      requested_outputs, top_k)
from optiserve.serve.preprocess import BadInput
from optiserve.text_input import IDS, MASK, SAMPLE_TEXT, TextInput, TextTokenizer, Tokens, token_batch

MAX_TEXT_BYTES = 64 << 10  # one text's UTF-8 bytes: far more than any model keeps (it truncates at max_length)
# what parsing one JSON string costs beside its characters: its str object's header and its slot in
# the list (a body of many short strings builds several times its own size)
PARSED_STRING_BYTES = 96
PARSED_OBJECT_BYTES = 4096  # and the body's object, its list and its keys
MAX_TOP_K = 1 << 20  # top_k is parsed before the model's classes are at hand; the answer clips it to them
WARM_LENGTH = 16  # the short length every batch size is warmed up at


class TooManyTexts(TooManyImages):
    """More texts than a queue holds: such a request can never be admitted (413, as for images)."""

    def __init__(self, texts: int, max_texts: int):
        BadInput.__init__(self, f"{texts} texts in one request, but a queue holds at most {max_texts} (the server's "
                                f"--max-queue; each text is a row): split it into smaller requests")


@dataclass
class TextRequest:
    """A request's texts, tokenized, with what its transport's envelope also said."""

    tokens: Tokens
    variant: str | None = None
    top_k: int | None = None  # a classifier's classes answered per text, as the body says (None: not said)


class TextRequests:
    """A served text model's input kind: the model's `TextInput`, its tokenizer (read once from the
    folder), and the most texts one request may carry (`max_texts`: rows of the queue)."""

    def __init__(self, folder: Path, text_input: TextInput, max_texts: int):
        self.input, self.max_texts = text_input, max_texts
        self.tokenizer = TextTokenizer(Path(folder) / text_input.tokenizer, text_input.max_length)

    # ---- texts in ----------------------------------------------------------------------------------
    def tokens(self, texts: list) -> Tokens:
        """`texts` checked (a non-empty list of strings, at most `max_texts`, each valid UTF-8 of at
        most MAX_TEXT_BYTES) and tokenized in one batched call; BadInput says what is wrong."""
        if not isinstance(texts, list) or not texts:
            raise BadInput("send a non-empty list of texts (strings)")
        if len(texts) > self.max_texts:
            raise TooManyTexts(len(texts), self.max_texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                kind = "a token id" if _token_ids(text) else f"a {type(text).__name__}"
                raise BadInput(f"text {i} is {kind}, not a string: send texts as strings (the server tokenizes them)")
            try:
                size = len(text.encode("utf-8"))
            except UnicodeEncodeError:
                raise BadInput(f"text {i} is not valid Unicode (a lone surrogate): send UTF-8 text") from None
            if size > MAX_TEXT_BYTES:
                raise BadInput(f"text {i} is {size:,} bytes, over the {MAX_TEXT_BYTES:,} a text may be (the model "
                               f"keeps at most {self.input.max_length} tokens of it)")
        tokens = self.tokenizer.encode(texts)
        if not tokens.lengths.all():  # a tokenizer that adds no special tokens, given nothing it keeps
            i = int(np.argmin(tokens.lengths))
            raise BadInput(f"text {i} ({texts[i][:40]!r}) has no tokens: the model's tokenizer keeps nothing of it, "
                           f"so the model has nothing to read; send text with at least one word")
        return tokens

    def predict_json(self, data: bytes, hold: Callable[[int], None] | None) -> TextRequest:
        """/predict's JSON for a text model: {"texts": [...], "variant"?, "top_k"?} (`top_k`: a classifier's
        classes per text, clipped to its classes where answered; an encoder's answer does not read it)."""
        if hold is not None:
            hold(parsed_size(data))
        body = parse_json(data)
        if "texts" not in body:
            hint = ' ("inputs" is for image models)' if "inputs" in body else ""
            raise BadInput(f'a text model takes JSON {{"texts": ["...", ...]}}{hint}')
        return TextRequest(self.tokens(body["texts"]), name_field(body.get("variant"), "variant"),
                           top_k(body.get("top_k"), MAX_TOP_K))

    def predict_plain(self, data: bytes) -> TextRequest:
        """A text/plain body: all of it is one text, in UTF-8."""
        return TextRequest(self.tokens([utf8(data, "the body")]))

    def infer_request(self, data: bytes, header_length: str | None, hold: Callable[[int], None] | None,
                      output_names: tuple[str, ...]) -> InferRequest:
        """The protocol's infer for a text model: one BYTES tensor [N] (or [N, 1]) of UTF-8 texts, as
        JSON `data` (a list of strings) or as binary tensor data (each element its 4-byte little-endian
        length, then its bytes: tritonclient's encoding). Its `images` are the texts' token batch."""
        try:
            head, tail = split_body(data, header_length)
        except BinaryFormatError as e:
            raise BadInput(str(e)) from None
        if hold is not None:
            hold(parsed_size(head))
        body = parse_json(head)
        params = object_field(body.get("parameters"), "parameters")
        inputs = body.get("inputs")
        if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
            raise BadInput('expected "inputs": [{"name": "text", "shape": [N], "datatype": "BYTES", "data": [...]}]')
        tensor = inputs[0]
        name_field(tensor.get("name"), "inputs[0].name", optional=False)
        shape = tensor.get("shape")
        count = self.check_tensor(shape, tensor.get("datatype"))
        size = object_field(tensor.get("parameters"), "inputs[0].parameters").get("binary_data_size")
        if size is None:
            if tail:
                raise BadInput(f"{len(tail)} bytes of binary data follow the JSON, but no input has binary_data_size")
            texts = tensor.get("data")
            if len(shape) == 2 and isinstance(texts, list) and len(texts) == count and \
                    all(isinstance(t, list) and len(t) == 1 for t in texts):
                texts = [t[0] for t in texts]  # shape [N, 1] sent nested
        else:
            if header_length is None:
                raise BadInput(f"binary_data_size needs the {binary.HEADER} header")
            if isinstance(size, bool) or not isinstance(size, int) or size != len(tail):
                raise BadInput(f"binary_data_size is {str(size)[:20]} but {len(tail):,} bytes follow the JSON")
            texts = bytes_elements(tail, count)
        if not isinstance(texts, list) or len(texts) != count:
            got = f"{len(texts)} texts" if isinstance(texts, list) else "no list of texts"
            raise BadInput(f"input data has {got} but shape {shape} needs {count}")
        tokens = self.tokens(texts)
        return InferRequest(tokens.batch, requested_outputs(body.get("outputs"), params, output_names),
                            id_field(body.get("id")), params.get("priority"), tokens.truncated)

    def check_tensor(self, shape, datatype) -> int:
        """The number of texts a protocol tensor declares (BYTES, shape [N] or [N, 1], N at most
        `max_texts`), checked before its data is read; BadInput / TooManyTexts otherwise."""
        if datatype != "BYTES":
            raise BadInput(f"a text model takes a BYTES tensor of UTF-8 texts, got datatype {str(datatype)[:20]!r}")
        if not (isinstance(shape, list) and len(shape) in (1, 2) and all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape) and shape[1:] in ([], [1])):
            raise BadInput(f"a text model's input shape is [N] (or [N, 1]): one text per row, got {str(shape)[:40]}")
        if shape[0] > self.max_texts:
            raise TooManyTexts(shape[0], self.max_texts)
        return shape[0]

    def metadata(self) -> dict:
        """The protocol's input of a text model: a BYTES tensor of UTF-8 texts."""
        return {"name": "text", "datatype": "BYTES", "shape": [-1]}

    # ---- batches -----------------------------------------------------------------------------------
    def stack(self, rows: list[np.ndarray]) -> np.ndarray:
        """Token rows [3, L_i] (each request's padded to its own longest text) as one batch [N, 3, L],
        L the longest text's own tokens (not a request's padding): ids padded with the tokenizer's pad
        id, mask and type ids with 0, which leaves every text's vector as it is alone."""
        lengths = [self.row_length(r) for r in rows]
        batch = np.zeros((len(rows), 3, max(lengths)), dtype=np.int64)
        batch[:, IDS] = self.tokenizer.pad_id
        for out, row, n in zip(batch, rows, lengths):
            out[:, :n] = row[:, :n]
        return batch

    @staticmethod
    def row_length(row: np.ndarray) -> int:
        """A token row's own tokens (its mask's ones: special tokens in, padding out; at least 1)."""
        return max(int(np.count_nonzero(row[MASK])), 1)

    @staticmethod
    def real_tokens(batch: np.ndarray) -> int:
        """The tokens a token batch's texts carry (special tokens included, padding not: its mask's
        ones), as the model keeps them after truncation at max_length."""
        return int(np.count_nonzero(batch[:, MASK]))

    def sample(self, n: int, lengths: list[int] | None = None) -> np.ndarray:
        """A token batch of `n` real texts: of the `lengths` in tokens that optimize timed the
        variants at (cycled; the manifest's `timed_text_lengths`), so that a server timing them
        again times what was recommended on; a short sentence each where none are recorded."""
        if not lengths:
            return self.tokenizer.encode([SAMPLE_TEXT] * n).batch
        from tokenizers import Tokenizer

        cut = Tokenizer.from_str(self.tokenizer.tokenizer.to_str())  # a copy: the request path shares the other
        text = " ".join([SAMPLE_TEXT] * (self.input.max_length // 8 + 1))  # longer than any length asked
        shortest = max(cut.num_special_tokens_to_add(False) + 1, 1)  # a text's specials and one token of it
        wanted = [min(max(int(lengths[i % len(lengths)]), shortest), self.input.max_length) for i in range(n)]
        rows = {}
        for length in sorted(set(wanted)):
            cut.enable_truncation(length)
            rows[length] = cut.encode(text)
        return token_batch([rows[length] for length in wanted], self.tokenizer.pad_id)

    def warm_up(self, variant: LoadedVariant, batch_sizes: list[int]) -> None:
        """Run each batch size the server forms that the backend needs warm, at a short length, as many
        times as it needs. No full-length batch: both text engines take a new sequence length without
        a first run's cost (their sequence axis is dynamic), so one would only cost start-up time and
        the memory of its activations."""
        backend = get_backend(variant.entry["backend"])
        short = self.tokenizer.encode([SAMPLE_TEXT]).batch[:, :, :WARM_LENGTH]
        warm_up_on(variant, [np.repeat(short, b, axis=0)
                             for b in backend.warm_sizes(list(batch_sizes), variant.session.device)])


def parsed_size(data: bytes) -> int:
    """The most bytes parsing a JSON body of texts builds, told to the byte budget before the parse:
    the body decoded and the strings' characters, each at most a character a byte at the widest
    character's size (Python stores a string at its widest), each string's own cost (a JSON string
    opens and closes with a quote, so the quotes bound how many there are), and the object holding
    them."""
    return 2 * len(data) * _character_bytes(data) + PARSED_STRING_BYTES * (data.count(b'"') // 2) + \
        PARSED_OBJECT_BYTES


_ESCAPE = re.compile(rb"\\u([0-9a-fA-F]{4})")


def _character_bytes(data: bytes) -> int:
    """The bytes a character of `data`'s widest takes in a Python string: 1 (Latin-1), 2 (the rest
    of the Basic Multilingual Plane) or 4, from its UTF-8 lead bytes and its `\\u` escapes."""
    width = 1
    if not data.isascii():
        lead = max(data)
        width = 4 if lead >= 0xF0 else 2 if lead >= 0xC4 else 1
    if width < 4 and b"\\u" in data:
        for match in _ESCAPE.finditer(data):
            point = int(match.group(1), 16)
            if 0xD800 <= point <= 0xDFFF:
                return 4
            if point > 0xFF:
                width = 2
    return width


def _token_ids(value) -> bool:
    """Whether `value` looks like token ids (an integer, or a list of them) rather than a text."""
    def integer(v):
        return isinstance(v, int) and not isinstance(v, bool)
    return integer(value) or (isinstance(value, list) and bool(value) and all(integer(v) for v in value))


def utf8(data: bytes, what: str) -> str:
    """`data` as text, or BadInput: the texts a model takes are UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{what} is not valid UTF-8 (byte {e.start}): send texts in UTF-8") from None


def bytes_elements(data: bytes, count: int) -> list[str]:
    """A BYTES tensor's binary data as texts (serve/binary.py reads the elements), each UTF-8; data
    holding more than the `count` its shape declares is refused before the rest is read."""
    try:
        elements = binary.bytes_elements(data, count)
    except BinaryFormatError as e:
        raise BadInput(str(e)) from None
    return [utf8(element, f"BYTES element {i}") for i, element in enumerate(elements)]
