"""ModelInferRequest read with its tensors left in place: the same message protobuf would parse."""

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from optiserve.grpc_protocol import pb
from optiserve.grpc_protocol.infer_wire import read_infer_request


def request(raw: list[bytes], **fields) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(**fields)
    message.inputs.add(name="input", datatype="FP32", shape=[1, 3, 8, 8])
    message.outputs.add(name="logits")
    message.raw_input_contents.extend(raw)
    return message


def same_as_protobuf(data: bytes):
    read = read_infer_request(data)
    whole = pb.ModelInferRequest.FromString(data)
    assert [bytes(r) for r in read.raw] == list(whole.raw_input_contents)
    whole.ClearField("raw_input_contents")
    assert read.request == whole
    return read


def test_the_tensor_bytes_are_views_of_the_received_message_not_copies():
    image = np.arange(192, dtype=np.float32).tobytes()
    data = request([image], model_name="m", model_version="v", id="r1").SerializeToString()
    read = same_as_protobuf(data)
    assert read.raw[0].obj is data and bytes(read.raw[0]) == image
    assert read.request.model_name == "m" and read.request.inputs[0].shape == [1, 3, 8, 8]
    assert not read.request.raw_input_contents


@settings(max_examples=200, deadline=None)
@given(raw=st.lists(st.binary(max_size=300), max_size=3), name=st.text(max_size=20), rid=st.text(max_size=5),
       params=st.dictionaries(st.text(max_size=8), st.integers(-2**40, 2**40), max_size=3),
       shuffle=st.randoms(use_true_random=False))
def test_any_request_reads_as_protobuf_reads_it_whatever_the_field_order(raw, name, rid, params, shuffle):
    message = request(raw, model_name=name, id=rid)
    for key, value in params.items():
        message.parameters[key].int64_param = value
    data = message.SerializeToString()
    same_as_protobuf(data)
    # senders may write fields in any order: cut the message into its fields and shuffle them
    fields, pos = [], 0
    while pos < len(data):
        start = pos
        pos += 1  # every tag here is one byte (field numbers < 16)
        length, shift = 0, 0
        while True:
            byte = data[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        pos += length
        fields.append(data[start:pos])
    shuffle.shuffle(fields)
    same_as_protobuf(b"".join(fields))


def test_a_field_of_another_wire_type_is_left_to_protobuf_which_reads_it_as_it_would():
    data = request([b"\0" * 12], model_name="m").SerializeToString() + bytes([15 << 3 | 0, 42])  # unknown varint field
    read = same_as_protobuf(data)
    assert bytes(read.raw[0]) == b"\0" * 12


@pytest.mark.parametrize("cut", [1, 5, -3])
def test_a_truncated_message_is_refused_as_protobuf_refuses_it(cut):
    data = request([b"\1" * 64], model_name="m").SerializeToString()[:cut]
    with pytest.raises(DecodeError):
        pb.ModelInferRequest.FromString(data)
    with pytest.raises(DecodeError):
        read_infer_request(data)
