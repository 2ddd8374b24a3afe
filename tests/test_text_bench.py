"""`bench` and `tune` on a text model: a seeded two-layer BERT encoder (max length 32, its WordPiece
tokenizer trained here on the polarity sentences) optimized to onnx-fp32 and onnx-int8. `bench http`
drives a real `optiserve serve` with the file's texts over /predict (JSON and text/plain), the Open
Inference Protocol's BYTES tensors (HTTP binary and gRPC) and /v1/embeddings, every request answered
and its texts and tokens those sent (tokens held to transformers' own tokenizer, texts to the
server's own count); `bench engine` times token batches of the texts; `tune` drives its points with
the texts and writes serving.json and tune.json; what does not fit is one line."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from conftest import BERT_ENCODER_NAME, BERT_MAX_LENGTH as MAX_LENGTH, free_port, run_cli_here, serving, until
from optiserve.bench.http import texts_for
from optiserve.artifacts import read_manifest
from optiserve.bench.results import load_results
from optiserve.errors import UserError

pytest.importorskip("onnxruntime")

NAME = BERT_ENCODER_NAME
PROTOCOLS = [("predict", 3), ("predict-raw", 1), ("v2-binary", 2), ("grpc", 4), ("openai", 2)]  # texts a request


def _served_counts(base: str) -> tuple[int, int]:
    """(requests answered, texts run) over every variant, as the server counts them."""
    model, = httpx.get(f"{base}/stats").json()["models"].values()
    variants = model["variants"].values()
    return sum(v["outcomes"].get("ok", 0) for v in variants), sum(v["images"] for v in variants)


def test_bench_http_sends_the_files_texts_over_every_protocol_and_counts_them(bert_encoder, tmp_path):
    pytest.importorskip("grpc")
    folder, data, lengths = bert_encoder
    grpc_port = free_port()
    with serving(folder, "--grpc-port", str(grpc_port)) as (base, _):
        for protocol, per in PROTOCOLS:
            out = tmp_path / f"{protocol}.json"
            before = _served_counts(base)
            # one caller, no warm-up: request j is the j-th sent, so it carried texts j*per .. j*per+per-1, cycling
            proc = run_cli_here("bench", "http", base, "--texts", f"text:{data}", "--texts-per-request", str(per),
                                "--tokenizer", str(folder), "--protocol", protocol, "--concurrency", "1",
                                "--duration", "0.3", "--warmup", "0", "--out", str(out), "--quiet",
                                *(["--grpc-target", f"127.0.0.1:{grpc_port}"] if protocol == "grpc" else []))
            assert proc.returncode == 0, proc.stderr
            run, = load_results(out)["runs"]
            n = len(run.records["ok"])
            assert n >= 3 and all(run.records["ok"]), (protocol, run.records["error"][:3])
            assert run.images_per_request == per
            assert run.records["tokens"] == [sum(lengths[(j * per + i) % len(lengths)] for i in range(per))
                                             for j in range(n)], protocol
            # the server answered every request and ran every text the results say were sent
            until(lambda: _served_counts(base) == (before[0] + n, before[1] + n * per), seconds=10)
            assert "texts/s" in proc.stdout and "tokens/s" in proc.stdout
        # a text model's load refused where it does not fit, in one line
        for args, says in [((), "is a text model: give --texts text:FILE"),
                           (("--texts", f"text:{data}", "--protocol", "openai", "--variants", "onnx-fp32"),
                            "/v1/embeddings names no variant"),
                           (("--texts", f"text:{data}", "--tokenizer", str(data.parent)), "no tokenizer.json there"),
                           (("--texts", f"text:{data.parent}"), "a folder; give one file"),
                           (("--texts", str(data)), "give text:FILE"),
                           (("--texts", f"text:{data}", "--texts-per-request", "2", "--protocol", "predict-raw"),
                            "a text/plain body is one text")]:
            proc = run_cli_here("bench", "http", base, *args, "--concurrency", "1", "--duration", "0.2",
                                "--out", str(tmp_path / "refused.json"), "--quiet")
            assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
                proc.stderr
    proc = run_cli_here("bench", "http", "http://127.0.0.1:9", "--texts-per-request", "2")
    assert proc.returncode == 2 and "go with --texts text:FILE" in proc.stderr

    report = tmp_path / "report"
    proc = run_cli_here("compare", str(tmp_path / "openai.json"), "--out", str(report), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    md = (report / "report.md").read_text()
    assert "| texts/s | tokens/s |" in md and f"texts: text:{data}, 2 a request" in md


def test_texts_to_an_image_model_are_one_line(bert_encoder):
    _, data, _ = bert_encoder
    image_model = {"model": "digits", "input": {"shape": [1, 28, 28]}}
    with pytest.raises(UserError, match="digits takes images, not texts: leave out --texts"):
        texts_for(image_model, f"text:{data}", 1, None, "predict", None)
    assert texts_for(image_model, None, 1, None, "predict", None) is None


def test_bench_engine_times_the_texts_optimize_would_time_drawn_from_the_file(bert_encoder, tmp_path):
    """Batch 1 and the largest batch are the texts `optimize --timing-texts FILE --latency-batch 4`
    times: drawn seeded, without replacement, the one of median length first; not the file's head."""
    from optiserve.data.timing_texts import timing_sample
    from optiserve.text_input import text_input_of, text_lengths

    folder, data, lengths = bert_encoder
    drawn, _ = timing_sample(data, text_input_of(read_manifest(folder)), folder, 4)
    want = [int(n) for n in text_lengths(drawn)]
    assert want[0] == sorted(want)[1] and want != lengths[:4]  # the median first, and not the file's first texts
    out = tmp_path / "engine.json"
    proc = run_cli_here("bench", "engine", str(folder), "--texts", f"text:{data}", "--batch-sizes", "1,4",
                        "--duration", "0.15", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    results = load_results(out)
    assert [(r.variant, r.level) for r in results["runs"]] == [("onnx-fp32", 1), ("onnx-fp32", 4),
                                                                ("onnx-int8", 1), ("onnx-int8", 4)]
    for run in results["runs"]:
        b = int(run.level)
        assert run.images_per_request == b and len(run.records["latency_ms"]) >= 3
        assert set(run.records["tokens"]) == {sum(want[:b])}  # the drawn texts, their padding not counted
    assert results["settings"]["seq_lengths"] == {"1": want[0], "4": max(want)}
    assert "texts/s" in proc.stdout and "tokens/s" in proc.stdout


def test_tune_drives_a_text_model_with_its_texts_and_its_token_budget_and_the_claim_replays(bert_encoder, tmp_path):
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tune_replay import check_claim

    folder, shared, lengths = bert_encoder
    tuned = tmp_path / NAME
    shutil.copytree(folder, tuned)
    data = tmp_path / shared.name  # changed below
    shutil.copy(shared, data)
    budget = 2 * MAX_LENGTH  # two full-length texts a batch, though four short ones fit
    args = ("tune", str(tuned), "--slo-p99-ms", "1000", "--texts", f"text:{data}", "--variants", "onnx-int8",
            "--batch-sizes", "4", "--batch-tokens", str(budget), "--delays-ms", "2", "--instances", "1",
            "--duration", "1", "--warmup", "0", "--confirm-seconds", "3", "--quiet")
    proc = run_cli_here(*args)
    assert proc.returncode == 0, proc.stderr
    assert f"max batch 4, at most {budget} padded tokens a batch" in proc.stdout
    settings = json.loads((tuned / "serving.json").read_text())
    assert settings["variants"] == ["onnx-int8"] and settings["max_batch_size"] == 4
    assert settings["max_batch_tokens"] == budget
    doc = json.loads((tuned / "tune.json").read_text())
    assert [p["max_batch_tokens"] for p in doc["points"]] == [budget]
    assert doc["winner"]["settings"]["max_batch_tokens"] == budget
    md = (tuned / "tune.md").read_text()
    assert "| max batch tokens |" in md and f"| 4 | {budget} |" in md
    # a server started from the folder serves with the budget tune wrote
    with serving(tuned) as (base, _):
        name, = httpx.get(f"{base}/stats").json()["models"]
        setting = httpx.get(f"{base}/v2/models/{name}/config").json()["settings"]["max_batch_tokens"]
        assert setting["value"] == budget and setting["source"] == "file", setting
        # replayed with the texts tune.json names, sent as tune sent them (whether a claim holds under a
        # shared machine's noise is tests/test_tune.py's subject): the server takes every one
        replay = check_claim(tuned, seconds=1, base=base)["replay"]
        assert replay["answered"] > 0 and not {"HTTP 400", "HTTP 413", "HTTP 415"} & set(replay["failures"]), replay
    # resumed with the same search, the budget is part of the point measured and the winner confirmed:
    # nothing is measured or confirmed again
    proc = run_cli_here(*args, "--resume")
    assert proc.returncode == 0, proc.stderr
    again = json.loads((tuned / "tune.json").read_text())
    assert again["points"] == doc["points"] and again["winner"]["confirmation"] == doc["winner"]["confirmation"]
    assert doc["load"] == {"texts": f"text:{data}", "texts_per_request": 1, "tokens_counted": True,
                           "sha256": doc["objective"]["load"]["sha256"]}
    assert doc["objective"]["load"] == {k: v for k, v in doc["load"].items() if k != "texts"}  # by contents, not path
    # the same file, changed since: its points were measured on other texts, so it starts over or stops
    data.write_text(data.read_text().replace("\n", " too\n", 1))
    proc = run_cli_here(*args, "--resume")
    assert proc.returncode != 0 and "load: sha256" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    steps = [s for p in doc["points"] for s in p["steps"]] + doc["winner"]["confirmation"]["tries"]
    for step in steps:  # one text a request, each of the file's texts' tokens
        assert step["texts"] == step["requests"] - step["failed"] > 0
        assert min(lengths) * step["texts"] <= step["tokens"] <= max(lengths) * step["texts"]


def test_tune_refuses_a_load_that_does_not_fit_in_one_line(bert_encoder, tmp_path):
    folder, data, _ = bert_encoder
    image = tmp_path / "image-model"
    image.mkdir()
    manifest = json.loads((folder / "manifest.json").read_text())
    (image / "manifest.json").write_text(json.dumps({**manifest, "input": {"shape": [1, 28, 28]}}))
    for target, args, says in [(folder, (), f"tuning the text model {NAME} needs --texts text:FILE"),
                               (folder, ("--texts", f"text:{data}", "--images", str(tmp_path)),
                                "is a text model: leave out --images"),
                               (image, ("--texts", f"text:{data}"), "takes images, not texts: leave out --texts"),
                               (folder, ("--texts", f"text:{data}", "--batch-tokens", f"{MAX_LENGTH - 1},{MAX_LENGTH}"),
                                f"--batch-tokens {MAX_LENGTH - 1}: below {NAME}'s max length {MAX_LENGTH}"),
                               (image, ("--batch-tokens", "64"), "image-model takes images: leave it out")]:
        proc = run_cli_here("tune", str(target), "--slo-p99-ms", "50", *args)
        assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
