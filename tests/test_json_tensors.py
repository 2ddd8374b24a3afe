"""JSON tensors read straight into arrays: the same numbers, shapes and errors as the standard parser
gives, for every body a client may send, without a Python float per value."""

from __future__ import annotations

import json
import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optiserve.input_spec import InputSpec
from optiserve.serve.envelope import MAX_NUMBER_CHARS, infer_request, parse_json, predict_request
from optiserve.serve.json_tensors import SCAN_BYTES, read_with_tensor
from optiserve.serve.preprocess import BadInput, ImageLimits
from optiserve.serve.protocol_input import ProtocolInput

pytest.importorskip("simdjson", reason="pysimdjson is a dependency of the server")

SPEC = InputSpec((1, 4, 4), (0.5,), (0.5,), "stretch")


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       seed=st.integers(0, 2 ** 32 - 1), as_ints=st.booleans())
def test_a_regular_nested_list_comes_back_as_the_array_json_gives(shape, seed, as_ints):
    rng = np.random.default_rng(seed)
    x = rng.integers(-1000, 1000, shape) if as_ints else rng.standard_normal(shape) * 10.0 ** rng.integers(-30, 30)
    body = json.dumps({"top_k": 2, "inputs": x.tolist(), "variant": "a", "more": {"b": [1, "c", None]}}).encode()
    fast = read_with_tensor(body, ("inputs",), MAX_NUMBER_CHARS)
    assert isinstance(fast["inputs"], np.ndarray) and fast["inputs"].shape == tuple(shape)
    standard = json.loads(body)
    np.testing.assert_array_equal(fast["inputs"], np.asarray(standard["inputs"], dtype=np.float64))
    assert {k: v for k, v in fast.items() if k != "inputs"} == {k: v for k, v in standard.items() if k != "inputs"}


@pytest.mark.parametrize("inputs", [[[1, 2], [3]], [[1, "x"]], [[True, 0.5]], [[1, None]], ["aGk=", "aGk="], [[]],
                                    {"a": 1}, 7, [1, [2]], [[1, 2], [[3], 4]], [[1, 2], [[3, 4], []]],
                                    [[1, 2], [3, [4]]]])
def test_what_is_not_a_regular_list_of_numbers_is_exactly_what_json_gives(inputs):
    body = json.dumps({"inputs": inputs}).encode()
    assert parse_json(body, tensor_at=("inputs",)) == json.loads(body)


@pytest.mark.parametrize("body, message", [
    (b'{"inputs": [NaN]}', None),                                   # json reads NaN; the tensor check refuses it
    (b'{"inputs": [' + b"9" * 5000 + b"]}", "5,000 characters long"),
    (b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
    (b'{"inputs": [1, 2,]}', "malformed JSON"),
    (b'[1, 2]', "must be an object"),
    (b'{"inputs": [1]} trailing', "malformed JSON"),
    pytest.param(b'{"inputs": [0.' + b"1" * 4998 + b"]}", "5,000 characters long", id="long-fraction"),
    pytest.param(b'{"inputs": [1], "top_k": 1.' + b"0" * 98 + b"}", "100 characters long", id="long-top-k"),
    pytest.param(b'{"inputs": [1e' + b"0" * 97 + b"1]}", "100 characters long", id="long-exponent"),
    pytest.param(b'{"inputs": [1], "x": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested too deeply",
                 id="deep-beside-the-tensor"),  # simdjson reads 1,024 deep
])
def test_a_body_the_fast_path_cannot_read_gets_the_standard_parsers_answer(body, message):
    assert read_with_tensor(body, ("inputs",), MAX_NUMBER_CHARS) is None
    if message is None:
        assert np.isnan(parse_json(body, tensor_at=("inputs",))["inputs"][0])
    else:
        with pytest.raises(BadInput, match=message):
            parse_json(body, tensor_at=("inputs",))


LONG = b"0." + b"1" * 65
SPLIT = b"1." + b"1" * 38 + b"e+" + b"0" * 22 + b"1"  # 65 characters, its longest run of - . / 0-9 only 40


@pytest.mark.parametrize("at, token", [(SCAN_BYTES - 40, LONG), (SCAN_BYTES - 2, LONG), (SCAN_BYTES + 1, LONG),
                                       (3 * SCAN_BYTES + 7, LONG), (SCAN_BYTES - 20, SPLIT)])
def test_a_long_number_or_a_list_in_a_row_past_the_first_piece_of_a_large_body_is_seen(at, token):
    head = b'{"inputs": [' + b"0.5, " * ((at - 12) // 5)
    head += b" " * (at - len(head))  # the token starts at byte `at`, across a piece's edge for some
    tail = b", 0.5" * 70_000 + b"]}"
    with pytest.raises(BadInput, match=f"{len(token)} characters long"):
        parse_json(head + token + tail, tensor_at=("inputs",))
    body = head + b"[0.5]" + tail
    assert parse_json(body, tensor_at=("inputs",)) == json.loads(body)


DEEP = b"[" * 65 + b"1" + b"]" * 65  # one dimension past what numpy holds, in a 150-byte body


def test_a_tensor_nested_past_what_an_array_holds_gets_the_standard_parsers_400():
    body = b'{"inputs": ' + DEEP + b"}"
    assert parse_json(body, tensor_at=("inputs",)) == json.loads(body)
    with pytest.raises(BadInput, match="inputs must be numbers in nested lists of equal length"):
        predict_request(body, SPEC, 10, 16, ImageLimits())
    infer = b'{"inputs": [{"name": "input", "shape": [1, 1, 4, 4], "datatype": "FP32", "data": ' + DEEP + b"}]}"
    with pytest.raises(BadInput, match="input data must be a \\(possibly nested\\) list of numbers"):
        infer_request(infer, None, ProtocolInput(SPEC), 16)


@pytest.mark.parametrize("body, path", [
    (b'{"inputs": [1, 2], "inputs": [3]}', ("inputs",)),
    (b'{"inputs": [3], "inputs": [1, [2]]}', ("inputs",)),
    (b'{"inputs": [1], "top_k": 1, "top_k": 2, "variant": "a", "variant": "b"}', ("inputs",)),
    (b'{"inputs": [1], "more": {"b": 1, "b": [2]}}', ("inputs",)),
    (b'{"inputs": [{"data": [1], "name": "x", "data": [2, 3], "name": "y"}]}', ("inputs", 0, "data")),
])
def test_a_repeated_key_keeps_its_last_value_as_the_standard_parser_does(body, path):
    fast = parse_json(body, tensor_at=path)
    assert json.loads(json.dumps(fast, default=lambda a: a.tolist())) == json.loads(body)


def test_predict_and_the_protocol_take_the_array_as_they_took_nested_lists():
    x = np.random.default_rng(1).standard_normal((3, 1, 4, 4)).astype(np.float32)
    request = predict_request(json.dumps({"inputs": x.tolist(), "top_k": 2}).encode(), SPEC, 10, 16, ImageLimits())
    np.testing.assert_array_equal(request.images, x)
    assert request.top_k == 2
    body = {"inputs": [{"name": "input", "shape": [3, 1, 4, 4], "datatype": "FP32", "data": x.ravel().tolist()}],
            "outputs": [{"name": "logits"}]}
    infer = infer_request(json.dumps(body).encode(), None, ProtocolInput(SPEC), 16)
    np.testing.assert_array_equal(infer.images, x)
    assert infer.outputs == [("logits", False)]
    with pytest.raises(BadInput, match="inputs contain NaN or Inf"):
        predict_request(b'{"inputs": [[[[NaN, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]]]}', SPEC, 10, 16,
                        ImageLimits())
    with pytest.raises(BadInput, match="expected \\[N, 1, 4, 4\\]"):
        predict_request(json.dumps({"inputs": [[[1.0, 2.0]]]}).encode(), SPEC, 10, 16, ImageLimits())


def test_a_json_request_carries_at_most_a_batch_of_images():
    x = np.zeros((17, 1, 4, 4)).tolist()
    with pytest.raises(BadInput, match="17 images in one request, but a JSON request may carry at most 16: a batch "):
        predict_request(json.dumps({"inputs": x}).encode(), SPEC, 10, 16, ImageLimits())
    many = np.zeros((200, 1, 4, 4)).tolist()  # past the commas any 16 images and the other fields could hold
    with pytest.raises(BadInput, match="a JSON request may carry at most 16 images of 1x4x4"):
        predict_request(json.dumps({"inputs": many}).encode(), SPEC, 10, 16, ImageLimits())


# The differential property: for any body, generated or mutated, the fast path gives exactly what the
# standard parser gives (parse_json without a tensor path is json.loads with the server's limits): the
# same values, the tensor as the float64 array of the same numbers, or the same 4xx with the same message.
# Bodies are written as text, so that they can hold what json.dumps never writes: repeated keys, any
# number token, ragged and deep lists.

WHITESPACE = st.sampled_from(["", " ", "\n", "\t", "\r\n  "])
NUMBERS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.floats(-1e3, 1e3, width=32).map(lambda f: f"{f:.9g}"),
    st.integers(-2 ** 70, 2 ** 70).map(str),
    st.from_regex(r"-?(0|[1-9][0-9]{0,70})(\.[0-9]{1,70})?([eE][+-]?[0-9]{1,40})?", fullmatch=True),
    st.sampled_from(["-0", "-0.0", "0e0", "1E400", "-1e-400", "NaN", "Infinity", "-Infinity", "01", "1.", ".5", "+1",
                     "18446744073709551615", "9223372036854775808", "-9223372036854775809", "1e-05", "0.0001"]))
STRINGS = st.one_of(st.text(max_size=8).map(json.dumps), st.text(max_size=8).map(lambda s: json.dumps(s, ensure_ascii=False)),
                    st.sampled_from(['"["', '"a[1]"', '"\\u005b"', '"\\ud800"', '"inputs"', '"FP32"', '"logits"']))
SCALARS = st.one_of(NUMBERS, STRINGS, st.sampled_from(["true", "false", "null"]))
KEYS = st.one_of(st.sampled_from(["inputs", "top_k", "variant", "data", "name", "shape", "datatype", "outputs",
                                  "parameters", "id", "a", ""]).map(json.dumps), STRINGS)


def _array(items: list[str], ws: str) -> str:
    return "[" + ws + f",{ws}".join(items) + ws + "]"


def _object(pairs: list[tuple[str, str]], ws: str) -> str:
    return "{" + ws + f",{ws}".join(f"{k}{ws}:{ws}{v}" for k, v in pairs) + ws + "}"


VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.builds(_array, st.lists(inner, max_size=4), WHITESPACE),
    st.builds(_object, st.lists(st.tuples(KEYS, inner), max_size=4), WHITESPACE)), max_leaves=12)


@st.composite
def number_lists(draw, size: int) -> list[str]:
    """`size` numbers as a client's encoder writes them (floats, float32s, integers, from 1e-8 to 1e8),
    a few of them replaced by any number token: drawn from a seed, which keeps the examples quick."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    values = rng.standard_normal(size) * 10.0 ** rng.integers(-8, 9, size)
    write = draw(st.sampled_from([lambda v: repr(float(v)), lambda v: f"{v:.9g}", lambda v: str(int(v))]))
    flat = [write(v) for v in values]
    for _ in range(draw(st.integers(0, 2))):
        flat[draw(st.integers(0, size - 1))] = draw(NUMBERS)
    return flat


@st.composite
def tensors(draw) -> str:
    """Nested lists of numbers: regular (sometimes the model's [N, 1, 4, 4]), then maybe made ragged,
    given a non-number, or nested past what an array holds."""
    shape = draw(st.one_of(st.lists(st.integers(1, 4), min_size=1, max_size=4),
                           st.builds(lambda n: [n, 1, 4, 4], st.integers(1, 2)), st.just([16])))
    ws = draw(WHITESPACE)
    flat = draw(number_lists(math.prod(shape)))

    def build(dims: list[int], at: int) -> str:
        if len(dims) == 1:
            return _array(flat[at:at + dims[0]], ws)
        step = math.prod(dims[1:])
        return _array([build(dims[1:], at + i * step) for i in range(dims[0])], ws)

    text = build(shape, 0)
    how = draw(st.sampled_from(["regular"] * 4 + ["ragged", "leaf list", "empty list", "other value", "deep"]))
    if how == "deep":
        depth = draw(st.integers(1, 100))
        return "[" * depth + draw(NUMBERS) + "]" * depth
    if how != "regular":
        numbers = [i for i, c in enumerate(text) if c not in "[], \r\n\t" and text[i - 1] in "[, \r\n\t"]
        i = numbers[draw(st.integers(0, len(numbers) - 1))]
        end = i + len(text[i:].split(",")[0].split("]")[0].rstrip())
        replacement = {"ragged": "", "leaf list": f"[{text[i:end]}]", "empty list": "[]",
                       "other value": draw(st.one_of(SCALARS, VALUES))}[how]
        text = text[:i] + replacement + text[end:]
    return text


def _body(pairs: list[tuple[str, str]], ws: str) -> bytes:
    return _object(pairs, ws).encode("utf-8", "surrogatepass")  # as json.loads decodes bytes


predict_bodies = st.builds(
    lambda first, rest, ws: _body(first + rest, ws),
    st.lists(st.tuples(st.just('"inputs"'), st.one_of(tensors(), VALUES)), min_size=0, max_size=2),
    st.lists(st.tuples(st.sampled_from(['"top_k"', '"variant"', '"inputs"']).map(str) | KEYS, VALUES), max_size=3),
    WHITESPACE)


@st.composite
def infer_bodies(draw) -> bytes:
    n = draw(st.integers(1, 2))
    data = draw(st.one_of(tensors(), st.just(_array(draw(number_lists(16 * n)), ""))))
    tensor = [('"name"', draw(st.sampled_from(['"input"', "7"]))), ('"shape"', f"[{n}, 1, 4, 4]"),
              ('"datatype"', draw(st.sampled_from(['"FP32"', '"FP16"', '"FP64"', '"INT8"']))), ('"data"', data)]
    tensor += draw(st.lists(st.tuples(KEYS, VALUES), max_size=2))
    ws = draw(WHITESPACE)
    pairs = [('"inputs"', _array([_object(draw(st.permutations(tensor)), ws)], ws))]
    pairs += draw(st.lists(st.tuples(st.sampled_from(['"outputs"', '"id"', '"parameters"', '"inputs"']), VALUES),
                           max_size=2))
    return _body(draw(st.permutations(pairs)), ws)


@st.composite
def mutated(draw, bodies) -> bytes:
    """A body with a few bytes deleted, inserted, replaced or repeated, or cut short."""
    body = bytearray(draw(bodies))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(body)))
        how = draw(st.sampled_from(["delete", "insert", "replace", "repeat", "cut"]))
        byte = draw(st.one_of(st.sampled_from(list(b'[]{},:"0123456789.eE+-\\ ntfu')), st.integers(0, 255)))
        if how == "delete":
            del body[at:at + draw(st.integers(1, 3))]
        elif how == "insert":
            body[at:at] = bytes([byte])
        elif how == "replace" and at < len(body):
            body[at] = byte
        elif how == "repeat":
            body[at:at] = body[at:at + draw(st.integers(1, 40))] * draw(st.integers(1, 3))
        elif how == "cut":
            del body[at:]
    return bytes(body)


def _same(fast, standard) -> bool:
    """Whether the fast path's value is the standard parser's: the same types and values (a float's
    sign and NaN included), and at the tensor's path a float64 array of the standard's numbers."""
    if isinstance(fast, np.ndarray):
        leaves, stack = [], [standard]
        while stack:
            v = stack.pop()
            stack.extend(v) if isinstance(v, list) else leaves.append(v)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in leaves):
            return False
        want = np.asarray(standard, dtype=np.float64)
        return want.shape == fast.shape and np.array_equal(want.view(np.uint64), fast.view(np.uint64))
    if type(fast) is not type(standard):
        return False
    if isinstance(fast, dict):
        return list(fast) == list(standard) and all(_same(fast[k], standard[k]) for k in fast)
    if isinstance(fast, list):
        return len(fast) == len(standard) and all(map(_same, fast, standard))
    if isinstance(fast, float):
        return np.float64(fast).tobytes() == np.float64(standard).tobytes() or (math.isnan(fast) and math.isnan(standard))
    return fast == standard


def _answer(read, *args):
    """What a request gets: the value read, or the 4xx's status and message."""
    try:
        return read(*args)
    except BadInput as e:
        return BadInput, e.status, str(e)


def _request_fields(request) -> dict:
    fields = dict(vars(request))
    fields["images"] = (fields["images"].dtype, fields["images"].shape, fields["images"].tobytes())
    return fields


def _assert_both_paths_answer_the_same(body: bytes) -> None:
    for path in (("inputs",), ("inputs", 0, "data")):
        fast, standard = _answer(parse_json, body, path), _answer(parse_json, body)
        assert _same(fast, standard), (fast, standard)
    with mock.patch("optiserve.serve.envelope.read_with_tensor", return_value=None):  # the standard parser alone
        standard = [_answer(predict_request, body, SPEC, 10, 16, ImageLimits()),
                    _answer(infer_request, body, None, ProtocolInput(SPEC), 16)]
    fast = [_answer(predict_request, body, SPEC, 10, 16, ImageLimits()),
            _answer(infer_request, body, None, ProtocolInput(SPEC), 16)]
    for f, s in zip(fast, standard):
        f, s = (_request_fields(x) if not isinstance(x, tuple) else x for x in (f, s))
        assert _same(f, s), (f, s)


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(predict_bodies, infer_bodies()))
def test_every_generated_body_gets_the_same_answer_from_the_fast_path_as_from_the_standard_parser(body):
    _assert_both_paths_answer_the_same(body)


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(mutated(predict_bodies), mutated(infer_bodies())))
def test_every_mutated_body_gets_the_same_answer_from_the_fast_path_as_from_the_standard_parser(body):
    _assert_both_paths_answer_the_same(body)
