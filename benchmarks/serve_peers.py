"""optiserve beside its peers, on one model file and one load generator, in alternating rounds.

Builds torchvision ResNet-18 at 224x224 (random weights: timing only) with `optimize --int8` and
serves its `onnx-int8` file by:

  - optiserve over HTTP: PNG uploads to /predict (dynamic batching);
  - optiserve over HTTP with the Open Inference Protocol's binary tensors (what tritonclient.http
    sends), and over gRPC with raw tensors (tritonclient.grpc) — the same server process;
  - a plain FastAPI + ONNX Runtime server, batch 1 (benchmarks/peers/fastapi_ort.py);
  - LitServe with its batching, same batch size and delay (benchmarks/peers/litserve_ort.py).

Each round starts each server in turn and gives each of its configurations one window of the same
closed loop (`optiserve.bench.loadgen`: the same client, the same 64 images), then stops it: one
server up at a time, since an idle server is not always idle (LitServe's workers poll their queues,
about a quarter of a core here, and would tax whichever server is being measured). Per window:
images/s, p50/p99, and the server's CPU per request read from /proc (utime + stime of the server
process and its children, over the measured window; the load client's own, beside it, since both
share the machine's cores). The offline ceiling is the same file through the runtime layer at
batch 16, measured in each round beside the servers (median over rounds), and "beyond inference"
is a server's CPU per request minus the model's own CPU per image measured offline at the batch
size that server formed (the mean batch, as the answers report it, rounded down to the nearest
measured size).

    python benchmarks/serve_peers.py
    python benchmarks/serve_peers.py --concurrency 32 --duration 20 --rounds 3 --artifacts /tmp/r18

Needs litserve for the LitServe peer (pip install "optiserve[peers]"; left out with a note without it);
the other peers need only the package's own dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.bench.loadgen import Load, generate_load, run_load, suits_uvloop  # noqa: E402
from optiserve.bench.payloads import dataset_images, image_tensors  # noqa: E402
from optiserve.bench.senders import BinaryTensorSender, GrpcSender, PredictSender  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.models import InputSpec  # noqa: E402
from optiserve.runtime import RuntimeOptions, load_session  # noqa: E402
from optiserve.runtime.timing import timed_calls  # noqa: E402
from optiserve.bench.results import Run  # noqa: E402
from optiserve.serve.launch import free_port, served, stop_group, wait_until_ready  # noqa: E402
from optiserve.serve.priority import INFERENCE_THREAD  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
OFFLINE_BATCHES = (1, 2, 4, 8, 16)


def stat_cpu(path: str) -> tuple[str, int, float] | None:
    """(name, parent pid, CPU seconds of user + system) from a /proc `stat` file; None once it is gone."""
    try:
        with open(path) as f:
            raw = f.read()
    except OSError:
        return None
    head, _, rest = raw.rpartition(")")
    fields = rest.split()
    return head[head.index("(") + 1:], int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by `pid` and every live descendant."""
    stats = {int(e): stat for e in os.listdir("/proc") if e.isdigit() and (stat := stat_cpu(f"/proc/{e}/stat"))}
    total = 0.0
    for p, (_, _, cpu) in stats.items():
        q = p
        while q and q != pid:
            q = stats[q][1] if q in stats else 0
        if q == pid:
            total += cpu
    return total


def inference_threads(pid: int) -> Iterator[tuple[str, float]]:
    """`pid`'s threads named as optiserve names its inference threads (the runtimes' worker threads
    inherit the name): each one's id and CPU seconds so far."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        if stat is not None and stat[0].startswith(INFERENCE_THREAD):
            yield tid, stat[2]


def inference_cpu_s(pid: int) -> float:
    """CPU seconds used so far by `pid`'s inference threads: the rest of the process is the request path."""
    return sum(cpu for _, cpu in inference_threads(pid))


def idle_cpu_s() -> float:
    """Seconds every core of the machine has spent idle so far (/proc/stat's idle and iowait)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[4]) + int(fields[5])) / TICK


def inference_waiting_s(pid: int) -> float:
    """Seconds `pid`'s inference threads have spent runnable but not running (each thread's
    /proc schedstat): the time other threads and processes held the cores they were ready for."""
    total = 0.0
    for tid, _ in inference_threads(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1]) / 1e9
        except OSError:  # the thread ended meanwhile
            pass
    return total


def measured_load(load: Load, sender, probe: Callable[[], tuple],
                  on_uvloop: bool | None = None) -> tuple[Run, tuple, tuple]:
    """Run `load` through `sender` on the loop `optiserve bench http` would (loadgen.suits_uvloop;
    `on_uvloop` says otherwise), reading `probe()` when its measured part starts (after the warm-up)
    and when it ends: the CPU counters of a window."""
    if on_uvloop is None:
        on_uvloop = suits_uvloop(load.mode, getattr(sender, "protocol", ""))
    marks = {}

    async def measure():
        async def mark():
            await asyncio.sleep(load.warmup_s)
            marks["start"] = probe()
        marker = asyncio.create_task(mark())
        run = await generate_load("", [], load, sender=sender)
        await marker
        marks["end"] = probe()
        return run

    run = run_load(measure(), on_uvloop)
    return run, marks["start"], marks["end"]


def offline(folder: Path, variant: str, spec: InputSpec, seconds: float) -> dict:
    """Images/s at batch 16 (the ceiling) and the model's CPU ms per image at each batch size."""
    manifest = read_manifest(folder)
    entry = next(v for v in manifest["variants"] if v["name"] == variant)
    session = load_session(folder / entry["file"], entry, manifest, RuntimeOptions(extra={"spin": False}))
    rng = np.random.default_rng(0)
    out = {"cpu_ms_per_image": {}}
    for batch in OFFLINE_BATCHES:
        x = rng.standard_normal((batch, *spec.shape), dtype=np.float32)
        timed_calls(session, x, calls=3)
        cpu0 = time.process_time()
        times = timed_calls(session, x, seconds=seconds / len(OFFLINE_BATCHES), min_calls=5)
        out["cpu_ms_per_image"][batch] = 1000 * (time.process_time() - cpu0) / (len(times) * batch)
        if batch == 16:
            out["ceiling"] = batch / (statistics.median(times) / 1000)
    return out


@contextlib.contextmanager
def peer(script: str, model_file: Path, *extra: str):
    """Run a peer server script on a free port until it answers /health; stop it and every process it
    started (LitServe's workers are processes of their own) afterwards."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "peers" / script), str(model_file),
                                 "--port", str(port), *extra], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        base = f"http://127.0.0.1:{port}"

        def output() -> str:
            log.seek(0)
            return log.read()

        try:
            wait_until_ready(base, 120, proc, output, path="/health")
            yield base, proc
        finally:
            stop_group(proc, 30, settle_s=1)  # LitServe's workers outlive their parent a moment


def window(sender, pid: int, args) -> dict:
    load = Load("closed", args.concurrency, args.duration, warmup_s=args.warmup, timeout_s=60)
    run, start, end = measured_load(load, sender, lambda: (tree_cpu_s(pid), time.process_time(), inference_cpu_s(pid)))
    server, client, inference = (1000 * (e - s) / max(1, sum(run.records["ok"])) for s, e in zip(start, end))
    summary = run.window_summary()
    ok = [b for b, good in zip(run.records["batch"], run.records["ok"]) if good and b]
    summary["mean_batch"] = float(np.mean(ok)) if ok else float("nan")
    summary["cpu_ms_per_request"], summary["client_ms_per_request"] = server, client
    summary["request_path_ms"] = server - inference if inference > 0 else float("nan")
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="onnx-int8")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per window")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each window is measured")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (every configuration once per round)")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-delay-ms", type=float, default=5.0)
    p.add_argument("--offline-seconds", type=float, default=10.0)
    p.add_argument("--only", default=None, help="comma-separated configurations to run (default all)")
    p.add_argument("--serve-args", default="", help="extra `optiserve serve` options, e.g. '--decode-threads 2'")
    p.add_argument("--artifacts", default=None, help="artifact folder to reuse (built there if missing)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.artifacts) if args.artifacts else Path(tmp) / "art"
        if not (folder / "manifest.json").is_file():
            from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

            run_optimize(OptimizeConfig("resnet18", weights="random", dataset="synthetic", int8=True,
                                        out=str(folder), progress=True))
        manifest = read_manifest(folder)
        model = manifest["model"]
        spec = InputSpec.from_dict(manifest["input"])
        if spec.shape[0] != 3:  # the peer scripts preprocess as ImageNet RGB classifiers do
            p.error(f"{folder} takes {spec.shape[0]}-channel input; the peers are written for RGB models "
                    f"(e.g. the default: resnet18 at 224x224, built when --artifacts is not given)")
        model_file = folder / next(v for v in manifest["variants"] if v["name"] == args.variant)["file"]
        images = dataset_images("synthetic", spec.shape[1], count=64)
        tensors = image_tensors(images, spec)
        offline_rounds = []
        batching = ["--max-batch-size", str(args.max_batch_size), "--max-delay-ms", str(args.max_delay_ms)]

        @contextlib.contextmanager
        def optiserve():
            grpc_port = free_port()
            with served(folder, "--variants", args.variant, "--grpc-port", str(grpc_port), "--max-queue", "1024",
                        *batching, *args.serve_args.split()) as (base, proc):
                yield proc.pid, {
                    "optiserve HTTP /predict (PNG)": lambda: PredictSender(base, images),
                    "optiserve HTTP v2 binary tensors": lambda: BinaryTensorSender(base, tensors, model),
                    "optiserve gRPC raw tensors": lambda: GrpcSender(f"127.0.0.1:{grpc_port}", tensors, model)}

        @contextlib.contextmanager
        def fastapi_peer():
            with peer("fastapi_ort.py", model_file, "--size", str(spec.shape[1])) as (base, proc):
                yield proc.pid, {"FastAPI + ORT, batch 1 (PNG)": lambda: PredictSender(base, images)}

        @contextlib.contextmanager
        def litserve_peer():
            with peer("litserve_ort.py", model_file, "--size", str(spec.shape[1]), "--max-batch-size",
                      str(args.max_batch_size), "--batch-timeout-ms", str(args.max_delay_ms)) as (base, proc):
                yield proc.pid, {"LitServe, batching (PNG)": lambda: PredictSender(base, images)}

        servers = {optiserve: "optiserve", fastapi_peer: "FastAPI", litserve_peer: "LitServe"}
        if not importlib.util.find_spec("litserve"):
            del servers[litserve_peer]
            print("LitServe left out: the litserve package is not installed (pip install litserve)", file=sys.stderr)
        wanted = [w.strip() for w in args.only.split(",")] if args.only else None
        if wanted:
            servers = {k: v for k, v in servers.items() if any(w.startswith(v) or v in w for w in wanted)}
        rounds: dict[str, list[dict]] = {}
        for r in range(args.rounds):
            # the model alone through the runtime layer, once a round like the servers: a noisy
            # moment then taxes one round of each, and the median over rounds sheds it
            offline_rounds.append(offline(folder, args.variant, spec, args.offline_seconds))
            # one server up at a time: an idle server still costs CPU (LitServe's workers poll their queues)
            for server in servers:
                with server() as (pid, configs):
                    for name, make in configs.items():
                        if wanted and not any(w in name for w in wanted):
                            continue
                        s = window(make(), pid, args)
                        rounds.setdefault(name, []).append(s)
                        print(f"round {r + 1} {name}: {s['rps']:.1f} img/s, p50 {s['p50']:.1f} ms, "
                              f"p99 {s['p99']:.1f} ms, {s['cpu_ms_per_request']:.2f} core-ms/request, "
                              f"mean batch {s['mean_batch']:.1f}, failed {s['failed']}", file=sys.stderr, flush=True)

    cpu_model = {b: statistics.median(o["cpu_ms_per_image"][b] for o in offline_rounds) for b in OFFLINE_BATCHES}
    ceiling = statistics.median(o["ceiling"] for o in offline_rounds)
    print(f"\nmachine: {cpu_line()}")
    print(f"\nresnet18 224x224 {args.variant}, {args.concurrency} closed-loop clients, {args.duration:g} s windows, "
          f"{args.rounds} alternating rounds, medians over rounds; batching max {args.max_batch_size}, "
          f"{args.max_delay_ms:g} ms\n")
    print(f"offline ceiling (batch 16, median of one window a round): {ceiling:.1f} images/s; the model's CPU per image: "
          + ", ".join(f"batch {b} {cpu_model[b]:.2f} ms" for b in OFFLINE_BATCHES) + "\n")
    print("| server | images/s | of ceiling | p50 ms | p99 ms | mean batch | server core-ms / request | "
          "beyond inference (offline model CPU subtracted) | outside inference threads (measured) | "
          "load client core-ms / request | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    medians = {}
    for name, windows in rounds.items():
        med = {k: statistics.median(w[k] for w in windows) for k in
               ("rps", "p50", "p99", "mean_batch", "cpu_ms_per_request", "client_ms_per_request",
                "request_path_ms")}
        batch = max([b for b in OFFLINE_BATCHES if b <= max(1.0, med["mean_batch"])])
        med["beyond"] = med["cpu_ms_per_request"] - cpu_model[batch]
        med["failed"] = sum(w["failed"] for w in windows)
        medians[name] = med
        print(f"| {name} | {med['rps']:.1f} | {med['rps'] / ceiling:.0%} | {med['p50']:.1f} | "
              f"{med['p99']:.1f} | {med['mean_batch']:.1f} | {med['cpu_ms_per_request']:.2f} | "
              f"{med['beyond']:.2f} | {_ms(med['request_path_ms'])} | {med['client_ms_per_request']:.2f} | "
              f"{med['failed']} |")
    peers = {k: v for k, v in medians.items() if not k.startswith("optiserve")}
    http = medians.get("optiserve HTTP /predict (PNG)")
    if peers and http:
        best_name, best = max(peers.items(), key=lambda kv: kv[1]["rps"])
        print(f"\noptiserve HTTP / best peer ({best_name}): {http['rps'] / best['rps']:.2f}x "
              f"images/s (target >= 1.25x), p99 {http['p99']:.1f} vs {best['p99']:.1f} ms (target: no higher); "
              f"CPU beyond inference {http['beyond']:.2f} core-ms/request by the offline model, "
              f"{http['request_path_ms']:.2f} outside the inference threads (target <= 1.2)")
    g, b = medians.get("optiserve gRPC raw tensors"), medians.get("optiserve HTTP v2 binary tensors")
    if g and b:
        # each round's two windows ran back to back in one server, so their ratio sheds the drift
        # between rounds that the ratio of medians carries
        per_round = [gw["rps"] / bw["rps"] for gw, bw in zip(rounds["optiserve gRPC raw tensors"],
                                                          rounds["optiserve HTTP v2 binary tensors"])]
        print(f"gRPC raw / HTTP binary tensors: {g['rps'] / b['rps']:.2f}x images/s (target >= 1); by round "
              + ", ".join(f"{r:.2f}x" for r in per_round) + f" (median {statistics.median(per_round):.2f}x)")
    return 0


def _ms(value: float) -> str:
    return "—" if value != value else f"{value:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
