"""JSON tensors read straight into arrays: the same numbers, shapes and errors as the standard parser
gives, for every body a client may send, without a Python float per value."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optiserve.input_spec import InputSpec
from optiserve.serve.envelope import infer_request, parse_json, predict_request
from optiserve.serve.json_tensors import read_with_tensor
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
    fast = read_with_tensor(body, ("inputs",))
    assert isinstance(fast["inputs"], np.ndarray) and fast["inputs"].shape == tuple(shape)
    standard = json.loads(body)
    np.testing.assert_array_equal(fast["inputs"], np.asarray(standard["inputs"], dtype=np.float64))
    assert {k: v for k, v in fast.items() if k != "inputs"} == {k: v for k, v in standard.items() if k != "inputs"}


@pytest.mark.parametrize("inputs", [[[1, 2], [3]], [[1, "x"]], [[True, 0.5]], [[1, None]], ["aGk=", "aGk="], [[]],
                                    {"a": 1}, 7])
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
])
def test_a_body_the_fast_path_cannot_read_gets_the_standard_parsers_answer(body, message):
    assert read_with_tensor(body, ("inputs",)) is None
    if message is None:
        assert np.isnan(parse_json(body, tensor_at=("inputs",))["inputs"][0])
    else:
        with pytest.raises(BadInput, match=message):
            parse_json(body, tensor_at=("inputs",))


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
