"""Serving a text-embedding model (all-MiniLM-L6-v2, optimized once per session by conftest's `optimized`):
/predict, the Open Inference Protocol's BYTES tensors and OpenAI's /v1/embeddings, each held to
sentence-transformers' own `encode` through an unmodified client (tritonclient, openai) where one
exists; the refusals are one line, never a 500."""

from __future__ import annotations

import base64
import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import free_port, minilm_folder, pipeline_repository, serving, until
from optiserve.serve.app import ServeConfig, create_app
from optiserve.serve.server import INLINE_TEXT_BYTES
from optiserve.text_input import TextTokenizer

MINILM = minilm_folder()
TEXTS = ["A gripping, beautifully shot film.", "it's not that bad", "Ünïcödé – fine ✓"]
LONG = "The plot collapses in the final act and no amount of star power can save it. " * 40  # over 256 tokens
VARIANTS = ["onnx-fp32", "onnx-int8"]


def _cosine(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' own vectors for a list of texts."""
    st = pytest.importorskip("sentence_transformers", reason="the reference encoder ([dev])")
    model = st.SentenceTransformer(str(MINILM), device="cpu")
    return lambda texts: model.encode(texts)


def _ready(client: TestClient, path: str = "/v2/health/ready") -> None:
    until(lambda: client.get(path).status_code == 200, seconds=120)


@pytest.fixture(scope="module")
def repo(optimized, small_artifact, tmp_path_factory):
    """A repository serving the text model (`minilm`) beside an image classifier (`digits`), a pipeline
    whose step names the text model, and gRPC on a free port: (HTTP client, gRPC port)."""
    root = pipeline_repository(tmp_path_factory.mktemp("text-repo") / "models",
                               {"minilm": optimized, "digits": small_artifact},
                               {"reads_text": {"steps": [{"model": "minilm"}, {"model": "digits"}]}})
    port = free_port()
    cfg = ServeConfig(str(root), variants=VARIANTS, ab="onnx-fp32=1", grpc_port=port)
    with TestClient(create_app(cfg)) as client:
        _ready(client, "/v2/models/minilm/ready")
        _ready(client, "/v2/models/digits/ready")
        yield client, port


# --- /predict ----------------------------------------------------------------------------------------

def test_predict_answers_texts_with_sentence_transformers_vectors(repo, reference):
    client, _ = repo
    r = client.post("/predict?model=minilm", json={"texts": TEXTS, "top_k": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "minilm" and body["variant"] == "onnx-fp32" and "server_ms" in body["latency_ms"]
    assert _cosine(body["embedding"], reference(TEXTS)).min() >= 0.999
    # ?variant= and ?normalize= as for images; a text/plain body is one text
    r = client.post("/predict?model=minilm&variant=onnx-int8&normalize=true", json={"texts": TEXTS[:1]})
    assert r.status_code == 200 and r.json()["variant"] == "onnx-int8"
    assert np.linalg.norm(r.json()["embedding"][0]) == pytest.approx(1.0, abs=1e-6)
    plain = client.post("/predict?model=minilm", content=TEXTS[2].encode(),
                        headers={"content-type": "text/plain; charset=utf-8"})
    assert plain.status_code == 200, plain.text
    np.testing.assert_allclose(plain.json()["embedding"][0], body["embedding"][2], atol=1e-5)
    # the body's own "variant" routes too
    assert client.post("/predict?model=minilm", json={"texts": ["x"], "variant": "onnx-int8"}).json()["variant"] \
        == "onnx-int8"


def test_a_small_body_is_tokenized_on_the_event_loop_and_a_large_one_on_the_decode_threads(repo, reference):
    """A sentence costs less to tokenize than two thread hand-offs, so it stays on the loop; many texts
    go to the decode threads, so that they never stop it. The answers are the same either way."""
    client, _ = repo
    texts = client.app.state.server.model("minilm").texts
    seen = []
    original = texts.tokens

    def tokens(batch):
        seen.append(threading.current_thread().name)
        return original(batch)

    texts.tokens = tokens
    try:
        small = client.post("/predict?model=minilm", json={"texts": TEXTS[:1]})
        large = client.post("/predict?model=minilm", json={"texts": TEXTS[:1] * 8 + [LONG]})
    finally:
        del texts.tokens
    assert small.status_code == 200 and large.status_code == 200, small.text + large.text
    assert len(json.dumps({"texts": TEXTS[:1]})) <= INLINE_TEXT_BYTES < len(json.dumps({"texts": [LONG]}))
    loop_thread = client.portal.call(threading.current_thread).name  # the thread the server's loop runs on
    assert seen[0] == loop_thread and seen[1].startswith("decode") and seen[1] != loop_thread, seen
    np.testing.assert_allclose(large.json()["embedding"][0], small.json()["embedding"][0], atol=1e-5)
    assert _cosine(large.json()["embedding"], reference(TEXTS[:1] * 8 + [LONG])).min() >= 0.999


@pytest.mark.parametrize("send, status, says", [
    (dict(json={"texts": []}), 400, "non-empty list of texts"),
    (dict(json={"texts": ["fine", 7]}), 400, "text 1 is a token id, not a string"),
    (dict(json={"texts": "one string"}), 400, "non-empty list of texts"),
    (dict(json={"inputs": [[0.0]]}), 400, '"inputs" is for image models'),
    (dict(content=b'{"texts": ["\xff\xfe"]}', headers={"content-type": "application/json"}), 400, "malformed JSON"),
    (dict(content=b"caf\xe9", headers={"content-type": "text/plain"}), 400, "not valid UTF-8 (byte 3)"),
    (dict(content=b"x", headers={"content-type": "text/plain; charset=latin-1"}), 415, "must be UTF-8"),
    (dict(content=b'{"texts": ["\\ud800"]}', headers={"content-type": "application/json"}), 400, "lone surrogate"),
    (dict(json={"texts": ["x"] * 257}), 413, "257 texts in one request, but a queue holds at most 256"),
    (dict(json={"texts": ["x" * (65 << 10)]}), 400, "over the 65,536 a text may be"),
    (dict(content=b"\x89PNG", headers={"content-type": "image/png"}), 415, "takes texts, not image/png"),
    (dict(content=b'{"texts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", headers={"content-type": "application/json"}),
     400, "nested too deeply"),
    # bodies small enough to be parsed on the event loop (Server.decode_texts) are refused the same way
    (dict(content=b'{"texts": ' + b"[" * 200 + b"]" * 200 + b"}", headers={"content-type": "application/json"}),
     400, "text 0 is a list, not a string"),
    (dict(content=b'{"texts": ["fine"], "texts": 5}', headers={"content-type": "application/json"}), 400,
     "non-empty list of texts"),  # duplicate keys: the last one holds, as the standard parser has it
    (dict(content=b'["fine"]', headers={"content-type": "application/json"}), 400, "must be an object"),
    (dict(content=b'{"texts": ["fine"]', headers={"content-type": "application/json"}), 400, "malformed JSON"),
])
def test_what_a_text_model_cannot_take_is_one_line(repo, send, status, says):
    client, _ = repo
    r = client.post("/predict?model=minilm", **send)
    assert r.status_code == status and says in r.json()["error"], r.text


def test_an_image_model_refuses_texts_in_one_line(repo):
    client, _ = repo
    r = client.post("/predict?model=digits", json={"texts": ["a"]})
    assert r.status_code == 400 and "takes images, not texts" in r.json()["error"]
    r = client.post("/predict?model=digits", content=b"a", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "takes images, not text" in r.json()["error"]


def test_a_text_the_tokenizer_keeps_nothing_of_is_a_400_and_its_batch_neighbours_are_answered(optimized, tmp_path):
    """A tokenizer that adds no special tokens makes no token of an empty or blank text: the model would
    have nothing to read. That text is refused on every transport, and a text batched beside it is
    answered as if it had come alone."""
    manifest = json.loads((optimized / "manifest.json").read_text())
    entry = next(v for v in manifest["variants"] if v["name"] == "onnx-fp32")
    folder = tmp_path / "bare"
    folder.mkdir()
    for name in ("manifest.json", entry["file"]):
        shutil.copy(optimized / name, folder / name)
    tokenizer = json.loads((optimized / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps({**tokenizer, "post_processor": None}))
    cfg = ServeConfig(str(folder), variants=["onnx-fp32"], max_batch_size=2, max_delay_ms=2000)
    with TestClient(create_app(cfg)) as client:
        _ready(client)
        with ThreadPoolExecutor(2) as pool:  # sent together: one batch, were the blank text let in
            blank, cat = pool.map(lambda texts: client.post("/predict", json={"texts": texts}), [["  "], ["a cat"]])
        assert blank.status_code == 400 and "text 0 ('  ') has no tokens" in blank.json()["error"], blank.text
        assert cat.status_code == 200 and cat.json()["latency_ms"]["batch_size"] == 1, cat.text
        r = client.post("/predict", json={"texts": ["a cat", ""]})
        assert r.status_code == 400 and "text 1 ('') has no tokens" in r.json()["error"]
        assert client.post("/v1/embeddings", json={"model": "model", "input": ""}).status_code == 400
        body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [""]}]}
        assert client.post("/v2/models/model/infer", json=body).status_code == 400


def test_padding_to_a_batch_s_longest_text_leaves_each_vector_as_it_is_alone(optimized):
    short, longer = ["ok"], ["The plot collapses in the final act, and no amount of star power can save it."]
    cfg = ServeConfig(str(optimized), variants=["onnx-fp32"], max_batch_size=2, max_delay_ms=3000)
    with TestClient(create_app(cfg)) as client:
        _ready(client)

        def post(texts):
            return client.post("/predict", json={"texts": texts}).json()

        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(post, [short, longer]))
        assert [t["latency_ms"]["batch_size"] for t in together] == [2, 2]  # one batch, padded to `longer`
        alone = [post(short + short), post(longer + longer)]  # batches of their own length
    for both, one in zip(together, alone):
        assert _cosine(both["embedding"], one["embedding"][:1]).min() >= 0.9999


def test_a_text_model_cuts_its_batches_as_soon_as_an_instance_is_free_unless_told_to_wait(repo, optimized):
    client, _ = repo
    window = lambda model: client.get(f"/v2/models/{model}/config").json()["settings"]["max_delay_ms"]
    assert window("minilm") == {"value": 0, "source": "default", "flag": "--max-delay-ms"}
    assert window("digits") == {"value": 5, "source": "default", "flag": "--max-delay-ms"}  # an image model waits
    # a window asked for, even the images' own, holds for texts too
    from optiserve.serve.model_settings import model_settings
    asked = model_settings(optimized, ServeConfig(str(optimized), max_delay_ms=5)).for_texts()
    assert (asked.max_delay_ms, asked.sources["max_delay_ms"]) == (5, "flag")


# --- the Open Inference Protocol ------------------------------------------------------------------

def test_protocol_metadata_declares_a_bytes_input_and_the_vectors(repo):
    client, _ = repo
    meta = client.get("/v2/models/minilm").json()
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]


@pytest.mark.parametrize("tensor, status, says", [
    ({"name": "text", "shape": [2], "datatype": "FP32", "data": [1, 2]}, 400, "takes a BYTES tensor"),
    ({"name": "text", "shape": [2, 3], "datatype": "BYTES", "data": ["a"] * 6}, 400, "shape is [N] (or [N, 1])"),
    ({"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a"]}, 400, "has 1 texts but shape [2] needs 2"),
    ({"name": "text", "shape": [1], "datatype": "BYTES", "data": [[1, 2]]}, 400, "text 0 is a token id"),
    ({"name": "text", "shape": [300], "datatype": "BYTES", "data": ["a"]}, 413, "300 texts in one request"),
    ({"name": "text", "shape": [2], "datatype": "BYTES", "data": [["a"], ["b"]]}, 400, "text 0 is a list"),
    ({"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 5}}, 400,
     "binary_data_size needs the Inference-Header-Content-Length header"),
])
def test_protocol_bytes_tensors_that_are_not_texts_are_one_line(repo, tensor, status, says):
    client, _ = repo
    r = client.post("/v2/models/minilm/infer", json={"inputs": [tensor]})
    assert r.status_code == status and says in r.json()["error"], r.text


def test_a_bytes_tensor_of_shape_n_by_1_may_be_sent_nested_or_flat(repo):
    client, _ = repo
    answers = [client.post("/v2/models/minilm/infer", json={"inputs": [
        {"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": data}]}) for data in (["a", "b"], [["a"], ["b"]])]
    assert [r.status_code for r in answers] == [200, 200], answers[1].text
    assert answers[0].json()["outputs"] == answers[1].json()["outputs"]


def test_binary_bytes_elements_that_are_not_utf8_cut_short_or_too_many_are_one_line(repo):
    client, _ = repo
    for tail, says in ((b"\x02\x00\x00\x00\xff\xfe", "BYTES element 0 is not valid UTF-8"),
                       (b"\x09\x00\x00\x00abc", "says 9 bytes but 3 are left"),
                       (b"\x01\x00\x00\x00a" * 3, "holds more than the 1 element its shape declares")):
        head = json.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                       "parameters": {"binary_data_size": len(tail)}}]}).encode()
        r = client.post("/v2/models/minilm/infer", content=head + tail,
                        headers={"Inference-Header-Content-Length": str(len(head))})
        assert r.status_code == 400 and says in r.json()["error"], r.text


def test_the_one_bytes_reader_reads_what_tritonclient_writes():
    """serve/binary.py's reader, which texts and pipeline images both go through, against tritonclient's
    own serializer: the same elements back, empty and non-ASCII ones included."""
    utils = pytest.importorskip("tritonclient.utils", reason="tritonclient is in the [dev] extra")
    from optiserve.serve.binary import BinaryFormatError, bytes_elements

    elements = [b"a cat", b"", "é ünïcödé".encode(), bytes(range(256)), b"\x00" * 5]
    written = utils.serialize_byte_tensor(np.array(elements, dtype=np.object_)).item()
    assert bytes_elements(written) == elements == bytes_elements(written, len(elements))
    assert bytes_elements(b"") == []
    with pytest.raises(BinaryFormatError, match=f"more than the {len(elements) - 1} elements"):
        bytes_elements(written, len(elements) - 1)
    with pytest.raises(BinaryFormatError, match="ends inside an element's 4-byte length"):  # stray bytes, not an element
        bytes_elements(written + b"\x01", len(elements))
    for cut in (written[:2], written[:-1]):
        with pytest.raises(BinaryFormatError):
            bytes_elements(cut)


# --- real servers, unmodified clients --------------------------------------------------------------

@pytest.fixture(scope="module")
def server(optimized):
    """`optiserve serve` of the text model's folder, a real process on a loopback port."""
    with serving(optimized, "--variants", "onnx-fp32") as (base, _):
        yield base


@pytest.mark.parametrize("binary", [True, False])
def test_an_unmodified_tritonclient_sends_bytes_tensors(server, reference, binary):
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the [dev] extra")
    client = httpclient.InferenceServerClient(url=server.removeprefix("http://"))
    name = "model"  # the folder's own name, as optimize recorded it
    assert client.get_model_metadata(name)["inputs"][0] == {"name": "text", "datatype": "BYTES", "shape": [-1]}
    text = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array(TEXTS, dtype=object), binary_data=binary)
    result = client.infer(name, [text], outputs=[httpclient.InferRequestedOutput("embedding", binary_data=binary)])
    vectors = result.as_numpy("embedding")
    assert vectors.shape == (len(TEXTS), 384) and _cosine(vectors, reference(TEXTS)).min() >= 0.999


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_the_openai_client_gets_sentence_transformers_vectors_and_the_tokens_counted(server, reference, encoding):
    openai = pytest.importorskip("openai", reason="the OpenAI client is in the [dev] extra")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    texts = [*TEXTS, LONG]
    answer = client.embeddings.create(model="model", input=texts, encoding_format=encoding)
    assert answer.object == "list" and answer.model == "model" and [d.index for d in answer.data] == [0, 1, 2, 3]
    # asked for by name, base64 comes back as sent (the client decodes it only where it chose base64 itself)
    vectors = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") if encoding == "base64" else d.embedding
                        for d in answer.data])
    assert _cosine(vectors, reference(texts)).min() >= 0.999  # the long text truncated at 256 tokens, as theirs is
    tokens = TextTokenizer(MINILM / "tokenizer.json", 256).encode(texts)
    assert tokens.lengths[-1] == 256 and tokens.truncated == 1
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == int(tokens.lengths.sum())
    one = client.embeddings.create(model="model", input=TEXTS[0], dimensions=384)  # the client's default: base64
    np.testing.assert_allclose(one.data[0].embedding, vectors[0], atol=1e-5)


def test_embeddings_answers_in_openai_s_own_shape(server):
    import httpx

    r = httpx.post(f"{server}/v1/embeddings", json={"model": "model", "input": ["a", "b"],
                                                    "encoding_format": "base64", "user": "ignored"})
    body = r.json()
    assert r.status_code == 200 and set(body) == {"object", "data", "model", "usage"}, r.text
    assert body["data"][1]["object"] == "embedding" and body["data"][1]["index"] == 1
    vector = np.frombuffer(base64.b64decode(body["data"][1]["embedding"]), dtype="<f4")
    floats = httpx.post(f"{server}/v1/embeddings", json={"model": "model", "input": "b", "encoding_format": None}).json()
    np.testing.assert_allclose(vector, floats["data"][0]["embedding"], atol=1e-6)
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6}  # [CLS] a [SEP], [CLS] b [SEP]


@pytest.mark.parametrize("body, status, says", [
    ({"model": "minilm", "input": [101, 2023, 102]}, 400, "holds token ids: send strings"),
    ({"model": "minilm", "input": [[101, 2023, 102]]}, 400, "send a string or a list of strings"),
    ({"model": "minilm", "input": []}, 400, "non-empty list of texts"),
    ({"model": "minilm", "input": ["a"], "dimensions": 128}, 400, "is not model 'minilm''s width 384"),
    ({"model": "minilm", "input": ["a"], "encoding_format": "int8"}, 400, '"encoding_format" is "float" or'),
    ({"model": "minilm", "input": ["a"], "encoding_format": False}, 400, '"encoding_format" is "float" or'),
    ({"model": "minilm", "input": ["a"], "encoding_format": ""}, 400, '"encoding_format" is "float" or'),
    ({"model": "nope", "input": ["a"]}, 404, "unknown model 'nope'"),
    ({"model": "digits", "input": ["a"]}, 400, "takes images; /v1/embeddings serves text-embedding models"),
    ({"input": ["a"]}, 400, '"model" must be a non-empty string'),
    ({"model": "minilm", "input": ["a", True]}, 400, "text 1 is a bool, not a string"),
    ({"model": "minilm", "input": None}, 400, "non-empty list of texts"),
    (["not", "an", "object"], 400, "must be an object"),
    (json.dumps({"model": "minilm", "input": ["a"]}).encode("utf-32"), 400, "the JSON body must be UTF-8"),
])
def test_embeddings_refusals_are_one_line(repo, body, status, says):
    client, _ = repo
    r = client.post("/v1/embeddings", **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == status and says in r.json()["error"], r.text


@pytest.mark.parametrize("escaped", [False, True], ids=["utf8", "escaped"])
@pytest.mark.parametrize("texts", [["ab"] * 50_000, ["\U0001F600"] * 20_000, ["a b c " * 20_000],
                                   ["A gripping, beautifully shot film."] * 1_000, ["a" * 100_000 + "\U0001F600"],
                                   ["a" * 100_000, "\u20ac"], ["caf\u00e9 " * 20_000]],
                         ids=["short", "emoji", "long", "sentences", "one-emoji", "one-euro", "latin-1"])
def test_what_a_text_body_s_parse_builds_is_held_before_it_runs(texts, escaped):
    """The byte budget is told at least what parsing the body allocates, measured by the interpreter."""
    import tracemalloc

    from optiserve.serve.envelope import parse_json
    from optiserve.serve.text_requests import parsed_size

    body = json.dumps({"texts": texts}, ensure_ascii=escaped).encode()  # escaped: "\\u20ac", as Python's json sends it
    tracemalloc.start()
    try:
        parse_json(body)
        built = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert built <= parsed_size(body) <= 8 * len(body) + 100 * len(texts) + 5_000


def test_a_body_of_many_short_texts_is_refused_by_the_byte_budget_before_it_is_parsed(repo, monkeypatch):
    client, _ = repo
    monkeypatch.setattr(client.app.state.server.memory, "limit", 8 << 20)
    many = ["ab"] * 200_000  # a body that parses into many times its own size
    for path, body in (("/predict?model=minilm", {"texts": many}), ("/v1/embeddings", {"model": "minilm", "input": many})):
        r = client.post(path, json=body)
        error = r.json()["error"]
        assert r.status_code == 413 and "parsing its JSON needs" in error and "--max-queue-bytes" in error, r.text
    assert client.post("/predict?model=minilm", json={"texts": ["ab"]}).status_code == 200


def test_embeddings_nested_too_deeply_is_a_400_not_a_500(repo):
    client, _ = repo
    deep = b'{"model": "minilm", "input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post("/v1/embeddings", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"], r.text


# --- gRPC, pipelines ------------------------------------------------------------------------------

def test_an_unmodified_tritonclient_grpc_sends_bytes_tensors(repo, reference):
    grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the [dev] extra")
    from tritonclient.utils import InferenceServerException

    _, port = repo
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    assert client.get_model_metadata("minilm", as_json=True)["inputs"] == [
        {"name": "text", "datatype": "BYTES", "shape": ["-1"]}]
    text = grpcclient.InferInput("text", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array(TEXTS, dtype=object))  # raw_input_contents, length-prefixed
    vectors = client.infer("minilm", [text]).as_numpy("embedding")
    assert vectors.shape == (len(TEXTS), 384) and _cosine(vectors, reference(TEXTS)).min() >= 0.999
    bad = grpcclient.InferInput("text", [1], "BYTES")
    bad.set_data_from_numpy(np.array([b"\xff\xfe"], dtype=object))
    with pytest.raises(InferenceServerException) as e:
        client.infer("minilm", [bad])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "BYTES element 0 is not valid UTF-8" in e.value.message()
    client.close()


def test_grpc_typed_bytes_contents_are_texts_too(repo, reference):
    grpc = pytest.importorskip("grpc", reason="grpcio is in the [dev] extra")
    from optiserve.grpc_protocol import pb, stub

    _, port = repo
    request = pb.ModelInferRequest(model_name="minilm")
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[len(TEXTS)])
    tensor.contents.bytes_contents.extend(t.encode() for t in TEXTS)
    too_many = pb.ModelInferRequest(model_name="minilm")
    # counted before any is decoded: the second, not UTF-8, is never read
    too_many.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.extend([b"a", b"\xff"])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = stub(channel).ModelInfer(request, timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            stub(channel).ModelInfer(too_many, timeout=30)
    (out,) = response.outputs
    vectors = np.array(out.contents.fp32_contents).reshape(list(out.shape))
    assert out.name == "embedding" and _cosine(vectors, reference(TEXTS)).min() >= 0.999
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input data has 2 texts but shape [1] needs 1" in refused.value.details()


def test_a_pipeline_step_naming_a_text_model_is_refused_with_the_reason(repo):
    client, _ = repo
    r = client.get("/v2/models/reads_text/ready")
    assert r.status_code == 503 and "step 1: model 'minilm' is a text model" in r.json()["error"], r.text


def test_the_default_variant_is_timed_on_token_batches(repo, monkeypatch):
    """Where no record applies, start-up times the variants on a batch of real texts' tokens."""
    from optiserve.runtime.recorded import Recorded

    client, _ = repo
    model = client.app.state.server.models["minilm"]
    monkeypatch.setattr("optiserve.serve.model.recorded_choice", lambda *a, **k: Recorded(None, "no record here"))
    assert model.sample_batch(4).dtype == np.int64 and model.sample_batch(4).shape[:2] == (4, 3)
    choice = model.choose_fastest(4, 1.0, None)
    assert choice["source"] == "timed" and choice["variant"] in VARIANTS
