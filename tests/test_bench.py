"""`optiserve bench` and `optiserve compare`: engine timings, the HTTP load generator against a real
server, honest open-loop timing, and the reports people read."""

from __future__ import annotations

import asyncio
import importlib.util
import csv
import json
import sys

import httpx
import numpy as np
import pytest

from conftest import free_port, run_cli, run_cli_here, serving
from optiserve.bench.loadgen import Load, generate_load, run_load, suits_uvloop
from optiserve.bench.payloads import dataset_images
from optiserve.bench.report import build_report, write_report
from optiserve.bench.results import PERF_ANALYZER_COLUMNS, Run, group_runs, load_results, make_results, save_results


def test_bench_engine_times_every_variant_and_batch_size_and_writes_results_and_csv(small_artifact, tmp_path):
    out = tmp_path / "engine.json"
    proc = run_cli("bench", "engine", str(small_artifact), "--variants", "fp32,onnx-int8", "--batch-sizes", "1,4",
                   "--duration", "0.15", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    results = load_results(out)
    assert results["kind"] == "engine" and results["model"]["name"] == "small_cnn"
    assert [(r.variant, r.level) for r in results["runs"]] == [("fp32", 1), ("fp32", 4), ("onnx-int8", 1),
                                                                ("onnx-int8", 4)]
    for run in results["runs"]:
        assert len(run.records["latency_ms"]) >= 5 and all(t > 0 for t in run.records["latency_ms"])
        assert run.images_per_request == run.level
    assert results["variants"]["onnx-int8"]["accuracy"]["top1"] > 0.5
    assert "torch" in results["environment"] and results["settings"]["batch_sizes"] == [1, 4]
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert list(rows[0])[:len(PERF_ANALYZER_COLUMNS)] == PERF_ANALYZER_COLUMNS
    assert {r["Variant"] for r in rows} == {"fp32", "onnx-int8"} and all(float(r["p99 latency"]) > 0 for r in rows)
    assert "engine batch 4" in proc.stdout and "onnx-int8" in proc.stdout


def test_bench_http_drives_a_real_server_closed_and_open_loop_and_compare_writes_the_report(small_artifact, tmp_path):
    out = tmp_path / "http.json"
    with serving(small_artifact, "--variants", "fp32,onnx-int8", "--ab", "fp32=0.5,onnx-int8=0.5") as (base, _):
        proc = run_cli_here("bench", "http", base, "--concurrency", "2", "--rate", "40", "--duration", "2",
                       "--warmup", "0.5", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    results = load_results(out)
    closed, opened = results["runs"]
    assert (closed.mode, closed.level, opened.mode, opened.level) == ("closed", 2, "open", 40)
    for run in results["runs"]:
        assert run.variant is None  # no --variants: the server's A/B split routed every request
        assert set(run.records["variant"]) == {"fp32", "onnx-int8"}
        assert all(run.records["ok"]) and set(run.records["status"]) == {200}
        assert all(b is not None and b >= 1 for b in run.records["batch"])
    assert 40 <= len(opened.records["latency_ms"]) <= 130  # Poisson arrivals at 40/s for 2 s
    intended = np.asarray(opened.records["t_s"])
    assert intended.min() >= 0 and intended.max() < 2.0  # warm-up requests are not recorded

    report_dir = tmp_path / "report"
    proc = run_cli_here("compare", str(out), "--baseline", "fp32", "--out", str(report_dir), "--resamples", "300")
    assert proc.returncode == 0, proc.stderr
    md = (report_dir / "report.md").read_text()
    assert "## Verdicts" in md
    assert "than fp32 at p50" in md or "no significant difference from fp32" in md
    assert "![Latency CDF per variant](latency_cdf.png)" in md
    html = (report_dir / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "<table>" in html  # plots embedded: one self-contained file
    for name in ("latency_cdf.png", "load_curve.png", "batch_sizes.png"):
        assert (report_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((report_dir / "report.json").read_text())
    group = next(g for g in data["groups"] if g["variant"] == "onnx-int8" and g["mode"] == "open")
    p50 = group["latency_ms"]["p50"]
    assert p50["ci"][0] <= p50["value"] <= p50["ci"][1]
    comparison = next(c for c in data["comparisons"] if c["candidate"] == "onnx-int8")
    assert set(comparison["speedup"]) == {"p50", "p99"} and len(comparison["speedup"]["p99"]["ci"]) == 2
    assert data["sources"][0]["environment"]["torch"] and data["sources"][0]["settings"]["rates"] == [40.0]


def test_bench_http_sends_the_same_images_as_uploads_raw_bodies_binary_tensors_or_grpc(small_artifact, tmp_path):
    pytest.importorskip("grpc")
    grpc_port = free_port()
    results = {}
    with serving(small_artifact, "--variants", "onnx-int8", "--grpc-port", str(grpc_port)) as (base, _):
        for protocol in ("predict", "predict-raw", "v2-binary", "grpc"):
            out = tmp_path / f"{protocol}.json"
            # in this process, through the command's own main: five interpreters' imports spared
            proc = run_cli_here("bench", "http", base, "--protocol", protocol, "--concurrency", "2", "--duration", "0.5",
                                "--warmup", "0", "--out", str(out), "--quiet",
                                *(["--grpc-target", f"127.0.0.1:{grpc_port}"] if protocol == "grpc" else []))
            assert proc.returncode == 0, proc.stderr
            results[protocol] = load_results(out)
        stats = httpx.get(f"{base}/stats").json()["models"]["small_cnn"]["variants"]["onnx-int8"]
        proc = run_cli_here("bench", "http", base, "--protocol", "grpc", "--grpc-target", f"127.0.0.1:{free_port()}",
                            "--duration", "1")
        assert proc.returncode == 2 and "no gRPC inference server answers" in proc.stderr
    for protocol, result in results.items():
        run, = result["runs"]
        assert result["settings"]["protocol"] == protocol and len(run.records["ok"]) > 10 and all(run.records["ok"])
        assert set(run.records["variant"]) == {"onnx-int8"}
    assert set(results["grpc"]["runs"][0].records["status"]) == {"OK"}
    assert all(b >= 1 for b in results["grpc"]["runs"][0].records["batch"])  # the server's timing, from the response
    sent = sum(len(r["runs"][0].records["ok"]) for r in results.values())
    assert stats["outcomes"]["ok"] >= sent  # every protocol's requests are counted by the same server (and warm-ups)


def test_compare_reads_a_running_servers_own_ab_traffic(small_artifact, tmp_path):
    import httpx

    pngs = dataset_images("digits", 16, count=8)
    with serving(small_artifact, "--variants", "fp32,onnx-int8", "--ab", "fp32=0.5,onnx-int8=0.5") as (base, _):
        for png in pngs * 5:
            assert httpx.post(f"{base}/predict", files={"file": ("d.png", png)}).status_code == 200
        proc = run_cli_here("compare", base, "--out", str(tmp_path), "--resamples", "200", "--no-plots")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["sources"][0]["kind"] == "server"
    counts = {g["variant"]: g["requests"] for g in data["groups"]}
    assert sum(counts.values()) == 40 and set(counts) == {"fp32", "onnx-int8"}
    assert not (tmp_path / "latency_cdf.png").exists()


def _service(delay_s: float, fail_every: int = 0):
    """An aiohttp app whose /predict takes `delay_s`, one request at a time (a server with one worker),
    answering 503 on every `fail_every`-th request."""
    from aiohttp import web

    lock = asyncio.Lock()
    served = {"n": 0}

    async def predict(request):
        await request.read()
        async with lock:
            await asyncio.sleep(delay_s)
            served["n"] += 1
            if fail_every and served["n"] % fail_every == 0:
                return web.json_response({"error": "overloaded on purpose"}, status=503)
            return web.json_response({"variant": "slow", "latency_ms": {"server_ms": 1000 * delay_s}})

    app = web.Application()
    app.router.add_post("/predict", predict)
    return app, served


async def _with_service(app, load: Load) -> Run:
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        return await generate_load(f"http://127.0.0.1:{port}", [b"png"], load)
    finally:
        await runner.cleanup()


def test_open_loop_latency_counts_the_wait_an_overloaded_server_causes():
    """A server that handles 20 requests/s, offered 40/s for 1.5 s: the queue grows, and a request
    arriving late waits for all before it. Timed from its send, every request would look like
    50 ms; timed from its intended arrival (as here) the tail shows the queueing users feel."""
    app, _ = _service(0.05)
    run = asyncio.run(_with_service(app, Load("open", 40, duration_s=1.5, warmup_s=0, max_connections=1, seed=3)))
    lat = np.asarray(run.records["latency_ms"])
    assert all(run.records["ok"]) and len(lat) >= 40
    assert np.percentile(lat, 50) > 150 and lat.max() > 500, "queueing behind the slow server must show"
    # the closed loop, one client, on the same server: each request waits only for itself
    closed = asyncio.run(_with_service(_service(0.05)[0], Load("closed", 1, duration_s=0.5, warmup_s=0)))
    assert np.percentile(closed.records["latency_ms"], 90) < 150


def test_failures_are_counted_with_their_reason_never_dropped():
    app, served = _service(0.005, fail_every=3)
    run = asyncio.run(_with_service(app, Load("closed", 2, duration_s=0.6, warmup_s=0)))
    ok = run.records["ok"]
    assert len(ok) == served["n"]  # every request sent in the window is in the records
    assert 0.25 <= ok.count(False) / len(ok) <= 0.4
    assert {s for s, good in zip(run.records["status"], ok) if not good} == {503}
    assert {e for e in run.records["error"] if e} == {"overloaded on purpose"}
    # this server names its variant only in successful answers: the failures are kept, unattributed
    groups = {g["variant"]: g for g in group_runs(make_results("http", [run], {}))}
    assert groups["(unrouted)"]["errors"] == groups["(unrouted)"]["statuses"]["503"] == ok.count(False)
    assert groups["slow"]["requests"] == len(groups["slow"]["latency_ms"]) == ok.count(True)


def test_the_load_generator_runs_on_uvloop_where_installed_and_on_asyncios_loop_otherwise(monkeypatch):
    """uvloop (uvicorn's standard extra installs it) spends less of the shared cores per request in
    a closed loop over HTTP; an open loop keeps asyncio's sub-millisecond timers, gRPC's asyncio
    client asyncio's own loop, and a machine without uvloop gets asyncio's loop too."""
    assert suits_uvloop("closed") and suits_uvloop("closed", "predict")
    assert not suits_uvloop("open") and not suits_uvloop("closed", "grpc") and not suits_uvloop("open", "grpc")

    async def load_on_its_loop():
        run = await _with_service(_service(0.001)[0], Load("closed", 2, duration_s=0.3, warmup_s=0))
        assert run.records["ok"] and all(run.records["ok"])
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    assert run_load(load_on_its_loop(), on_uvloop=False) == "asyncio"
    with monkeypatch.context() as without:
        without.setitem(sys.modules, "uvloop", None)  # not installed: importing it fails
        assert run_load(load_on_its_loop()) == "asyncio"
    if importlib.util.find_spec("uvloop") is not None:
        assert run_load(load_on_its_loop()) == "uvloop"


def test_an_open_loop_request_is_never_timed_from_before_it_was_sent():
    """On uvloop, whose timers count whole milliseconds, an arrival's sleep can end early: the
    request is then timed from its send, and no send lag comes out below zero."""
    uvloop = pytest.importorskip("uvloop")
    app, _ = _service(0.0)
    run = uvloop.run(_with_service(app, Load("open", 400, duration_s=1.0, warmup_s=0, seed=5)))
    assert len(run.records["ok"]) > 200 and all(run.records["ok"])
    assert min(run.records["send_lag_ms"]) >= 0


def test_a_window_in_which_every_request_failed_is_a_step_that_meets_nothing_not_an_error():
    from optiserve.bench.tune import _summary, missed

    app, served = _service(0.001, fail_every=1)
    run = asyncio.run(_with_service(app, Load("closed", 2, duration_s=0.3, warmup_s=0)))
    assert run.records["ok"] and not any(run.records["ok"])
    window = run.window_summary()
    assert window["rps"] == 0 and window["failed"] == window["requests"] == len(run.records["ok"])
    assert window["p99"] == float("inf")
    step = _summary(run, None, 0.3)
    assert missed(step, 1e9) == [f"none of {step['requests']} requests answered"]


def test_an_unreachable_server_and_bad_files_are_one_line_errors(tmp_path):
    proc = run_cli("bench", "http", f"http://127.0.0.1:{free_port()}", "--duration", "1")
    assert proc.returncode == 2 and "cannot reach" in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    proc = run_cli_here("compare", str(bad), "--out", str(tmp_path / "r"))
    assert proc.returncode == 2 and "not an optiserve results file" in proc.stderr
    proc = run_cli_here("compare", str(tmp_path / "missing.json"), "--out", str(tmp_path / "r"))
    assert proc.returncode == 2 and "no such results file" in proc.stderr


def test_results_round_trip_and_an_unknown_baseline_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    runs = [Run("engine", 1, name, 1.0, 1, {"latency_ms": list(rng.lognormal(mu, 0.2, 300)), "ok": [True] * 300})
            for name, mu in (("fp32", 2.0), ("int8", 1.3))]
    path = save_results(make_results("engine", runs, {"duration_s": 1.0},
                                     variants={"fp32": {"accuracy": {"top1": 0.99}},
                                               "int8": {"accuracy": {"top1": 0.985}}}), tmp_path / "r.json")
    back = load_results(path)
    assert back["runs"][1].records["latency_ms"] == runs[1].records["latency_ms"]
    report = build_report([("r.json", back)], resamples=300)
    (c,) = report["comparisons"]
    assert report["baseline"] == "fp32" and c["speedup"]["p50"]["value"] == pytest.approx(np.exp(0.7), rel=0.05)
    assert "× faster than fp32 at p50 (95% CI" in c["verdict"] and c["verdict"].endswith("0.5 points less accurate")
    files = write_report(report, tmp_path / "out", plots=False)
    assert set(files) == {"md", "html", "json", "csv"}
    from optiserve.errors import UserError

    with pytest.raises(UserError, match="--baseline 'fp16' is not in the results"):
        build_report([("r.json", back)], baseline="fp16")
