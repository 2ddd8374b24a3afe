"""Hypothesis strategies for structurally hostile requests to the server: JSON of every shape and
type where /predict and the protocol expect particular fields, deep nesting and huge numbers,
multipart bodies with broken images and odd fields, and binary-extension bodies whose header
length, sizes and tails disagree. Used by tests/test_serve_fuzz.py (a bounded run in the suite)
and benchmarks/fuzz_serve.py (a long run)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st
from PIL import Image

MODEL = "small_cnn"
SHAPE = [1, 1, 16, 16]  # the small digits model's input


@dataclass
class HostileRequest:
    path: str
    content: bytes
    headers: dict = field(default_factory=dict)

    def __repr__(self) -> str:  # hypothesis prints the failing example: keep it readable
        return f"HostileRequest({self.path!r}, {self.content[:300]!r}{'...' if len(self.content) > 300 else ''}, {self.headers!r})"


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=10 ** 30, max_value=10 ** 80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["fp32", "onnx-int8", "FP32", "FP16", "INT8", "input", "logits", "probabilities", ""]))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=30)


def _nested(depth: int, leaf) -> object:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


tensors = st.one_of(
    json_values,
    st.builds(lambda n, v: np.full((n, 1, 16, 16), v).tolist(), st.integers(0, 3), st.floats(-1e3, 1e3)),
    st.builds(lambda shape: np.zeros(shape).tolist(), st.lists(st.integers(0, 17), min_size=1, max_size=5)),
    st.builds(_nested, st.integers(1, 200), scalars),  # past numpy's 64 dimensions, within json.dumps' reach
)


@st.composite
def png_bytes(draw) -> bytes:
    """A real PNG, then maybe truncated or with bytes flipped."""
    w, h = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    mode = draw(st.sampled_from(["L", "RGB", "RGBA", "P", "1", "I;16"]))
    buf = io.BytesIO()
    Image.new(mode, (w, h)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    how = draw(st.sampled_from(["whole", "truncated", "flipped"]))
    if how == "truncated":
        data = data[:draw(st.integers(0, len(data)))]
    elif how == "flipped":
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


def _json_request(path: str, body) -> HostileRequest:
    return HostileRequest(path, json.dumps(body).encode(), {"content-type": "application/json"})


paths = st.sampled_from(["/predict", "/predict?variant=fp32", "/predict?variant=onnx-int8", "/predict?variant=int4",
                         "/predict?top_k=3", "/predict?top_k=-1", "/predict?top_k=1e999", "/predict?top_k=%C2%B2"])
infer_paths = st.sampled_from([f"/v2/models/{MODEL}/infer", f"/v2/models/{MODEL}/versions/onnx-int8/infer",
                               f"/v2/models/{MODEL}/versions/int4/infer"])

predict_json = st.builds(
    _json_request, paths,
    st.one_of(json_values,
              st.fixed_dictionaries({"inputs": tensors},
                                    optional={"variant": json_values, "top_k": json_values}),
              st.fixed_dictionaries({"inputs": st.lists(st.one_of(st.text(max_size=30), png_bytes().map(
                  lambda b: __import__("base64").b64encode(b).decode())), max_size=3)},
                                    optional={"variant": json_values})))

raw_bodies = st.builds(
    lambda path, body, ctype: HostileRequest(path, body, {"content-type": ctype}),
    st.one_of(paths, infer_paths),
    st.one_of(st.binary(max_size=200),
              st.builds(lambda n: b'{"inputs": ' + b"[" * n + b"]" * n + b"}", st.integers(1, 200_000)),
              st.builds(lambda n, x: b'{"inputs": ' + b"[" * n + x.encode() + b"]" * n + b"}", st.integers(1, 2000),
                        st.sampled_from(["1", "-0.5", '"a"', "null", "[]", "{}"])),
              st.builds(lambda n: (b'{"inputs": [{"name": "input", "shape": [1, 1, 16, 16], "datatype": "FP32", '
                                   b'"data": ' + b"[" * n + b"1" + b"]" * n + b"}]}"), st.integers(1, 2000)),
              st.builds(lambda n: b'{"inputs": [[[[' + b"9" * n + b"]]]]}", st.integers(1, 10_000)),
              st.builds(lambda n: b'{"inputs": [[[[1e' + str(n).encode() + b"]]]]}", st.integers(-500, 500))),
    st.sampled_from(["application/json", "", "text/plain", "multipart/form-data", "application/octet-stream"]))

tensor_specs = st.fixed_dictionaries(
    {}, optional={"name": json_values, "shape": st.one_of(json_values, st.just(SHAPE),
                                                           st.lists(st.integers(-2, 10 ** 19), max_size=9)),
                  "datatype": st.one_of(json_values, st.sampled_from(["FP32", "FP16", "FP64"])),
                  "data": tensors, "parameters": st.one_of(json_values, st.fixed_dictionaries(
                      {"binary_data_size": st.one_of(json_values, st.integers(-4, 4096))}))})
infer_bodies = st.fixed_dictionaries(
    {}, optional={"inputs": st.one_of(json_values, st.lists(tensor_specs, max_size=2)),
                  "outputs": st.one_of(json_values, st.lists(st.fixed_dictionaries(
                      {"name": st.one_of(json_values, st.sampled_from(["logits", "probabilities"]))},
                      optional={"parameters": json_values}), max_size=3)),
                  "parameters": json_values, "id": json_values})
infer_json = st.builds(_json_request, infer_paths, infer_bodies)


@st.composite
def infer_binary(draw) -> HostileRequest:
    """JSON header + raw tail, with the header length right, wrong or not a number."""
    head = json.dumps(draw(infer_bodies)).encode()
    tail = draw(st.one_of(st.binary(max_size=2048), st.builds(lambda n: bytes(n), st.sampled_from([0, 512, 1024, 1028, 2048]))))
    length = draw(st.one_of(st.just(str(len(head))), st.integers(-5, len(head) + 3000).map(str),
                            st.from_regex(r"[0-9a-z+.\-]{1,12}", fullmatch=True)))
    return HostileRequest(draw(infer_paths), head + tail, {"inference-header-content-length": length,
                                                          "content-type": "application/octet-stream"})


@st.composite
def multipart(draw) -> HostileRequest:
    boundary = "fuzzboundary"
    parts = []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["file", "variant", "other", "file\"x", ""]))
        filename = draw(st.one_of(st.none(), st.sampled_from(["d.png", "", "../../x"])))
        value = draw(st.one_of(png_bytes(), st.binary(max_size=100), st.text(max_size=20).map(str.encode)))
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        parts.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n")
    body = b"".join(parts) + (f"--{boundary}--\r\n".encode() if draw(st.booleans()) else b"")
    ctype = draw(st.sampled_from([f"multipart/form-data; boundary={boundary}", "multipart/form-data",
                                  "multipart/form-data; boundary=other"]))
    return HostileRequest(draw(paths), body, {"content-type": ctype})


hostile_requests = st.one_of(predict_json, raw_bodies, infer_json, infer_binary(), multipart())


def send(client, request: HostileRequest):
    """POST the request with an httpx client; the response."""
    return client.post(request.path, content=request.content, headers=request.headers)
