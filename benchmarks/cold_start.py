"""How fast a server starts and how much memory it holds: optiserve beside a plain FastAPI + ONNX
Runtime server on the same model file.

Each round starts, in turn and one at a time on a quiet machine:

  - the plain peer (benchmarks/peers/fastapi_ort.py: FastAPI, one ONNX Runtime session) on the
    224x224 ResNet-18's `onnx-int8` file;
  - `optiserve serve` on that artifact folder with `--variants onnx-int8`, and with
    `--variants openvino-int8` (or another OpenVINO variant when that one was not accepted);
  - `optiserve serve` on the digits folder with every accepted variant (seven with torch installed).

"Ready" is the time from starting the process to the first 200 from its readiness endpoint (the
peer's /health answers once its session is loaded; optiserve's /v2/health/ready once every variant
is loaded, warm and its default chosen), polled every 50 ms: each poll costs CPU in both processes,
and polling every 10 ms on 2 cores slowed the warm-up of optiserve's torch variants several-fold
(their threads run at a lower priority than anything else, the poller included), which no
Kubernetes probe (every second at most) does. Resident memory (VmRSS, plus
children) is read after 20 answered requests. Medians over the rounds, with the ratios to the
peer. Then the import time of the serving path by top-level package (`python -X importtime`).

    python benchmarks/cold_start.py
    python benchmarks/cold_start.py --rounds 5 --artifacts /tmp/r18 --digits artifacts/resnet18-digits

The 224x224 ResNet-18 (random weights: timing only) is built with `optimize --int8` when
--artifacts does not hold it; the digits folder is built (training first, as the quickstart does)
when --digits does not hold one. Needs the [all] install (to build them).
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import free_port, stop  # noqa: E402

REQUESTS = 20
POLL_S = 0.05


def rss_bytes(pid: int) -> int:
    """VmRSS of `pid` and its children (uvicorn serves from the process itself; counted anyway)."""
    total = 0
    pids = [pid]
    with_children = Path(f"/proc/{pid}/task/{pid}/children")
    if with_children.exists():
        pids += [int(p) for p in with_children.read_text().split()]
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def png(size: int, channels: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 255, (size, size, 3) if channels == 3 else (size, size), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def start_and_measure(command: list[str], ready_url: str, predict_url: str, image: bytes | None,
                      within_s: float = 180, body: dict | None = None) -> tuple[float, int]:
    """Seconds from start to the first 200 from `ready_url`, and the resident bytes after REQUESTS
    answered uploads of `image` (or JSON `body`s) to `predict_url`; the process is stopped afterwards."""
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            with httpx.Client(timeout=5) as client:
                while True:
                    try:
                        if client.get(ready_url).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if proc.poll() is not None or time.perf_counter() - t0 > within_s:
                        log.seek(0)
                        raise RuntimeError(f"{' '.join(command)} did not become ready:\n{log.read()[-3000:]}")
                    time.sleep(POLL_S)
                ready_s = time.perf_counter() - t0
                for _ in range(REQUESTS):
                    r = client.post(predict_url, json=body) if body is not None else \
                        client.post(predict_url, files={"file": ("x.png", image, "image/png")})
                    r.raise_for_status()
            return ready_s, rss_bytes(proc.pid)
        finally:
            stop(proc, 30)


def print_table(results: dict[str, list[tuple[float, int]]]) -> None:
    """Each server's median ready time and resident memory, and their ratios to the first's (the peer)."""
    peer = next(iter(results.values()))
    peer_ready = statistics.median(r for r, _ in peer)
    peer_rss = statistics.median(m for _, m in peer)
    print()
    print("| server | ready s (median) | × peer | RSS MB after 20 requests | × peer |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        ready = statistics.median(r for r, _ in runs)
        rss = statistics.median(m for _, m in runs)
        print(f"| {name} | {ready:.2f} | {ready / peer_ready:.2f}× | {rss / 1e6:.0f} | {rss / peer_rss:.2f}× |")


def optiserve_command(folder: Path, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "optiserve", "serve", str(folder), "--port", str(port), "--drain-seconds", "0", *args]


def import_times(module: str = "optiserve.serve.app") -> list[tuple[str, float]]:
    """Import time (s) of `module` and everything it imports, by top-level package (each module's own
    time, `python -X importtime`'s "self"), largest first."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], capture_output=True,
                          text=True, check=True)
    by_package: dict[str, float] = collections.defaultdict(float)
    for line in proc.stderr.splitlines():
        parts = line[len("import time:"):].split("|") if line.startswith("import time:") else []
        if len(parts) != 3 or not parts[0].strip().isdigit():
            continue
        by_package[parts[2].strip().split(".")[0]] += int(parts[0]) / 1e6
    return sorted(by_package.items(), key=lambda kv: -kv[1])


def build_r18(folder: Path) -> None:
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

    run_optimize(OptimizeConfig("resnet18", weights="random", dataset="synthetic", int8=True, out=str(folder),
                                progress=True))


def build_digits(folder: Path) -> None:
    subprocess.run([sys.executable, "-m", "optiserve", "optimize", "resnet18", "--int8", "--out", str(folder)],
                   check=True)


def openvino_variant(manifest: dict) -> str | None:
    names = [v["name"] for v in manifest["variants"]  # random weights leave them unvalidated; served all the same
             if v["status"] in ("accepted", "unvalidated") and v["backend"] == "openvino"]
    return next((n for n in ("openvino-int8", "openvino-fp32", *names) if n in names), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--artifacts", default=None, help="the 224x224 ResNet-18 folder to reuse (built there if missing)")
    p.add_argument("--digits", default=None, help="the digits folder to reuse (built there if missing)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        r18 = Path(args.artifacts or Path(tmp) / "r18")
        digits = Path(args.digits or Path(tmp) / "digits")
        if not (r18 / "manifest.json").is_file():
            build_r18(r18)
        if not (digits / "manifest.json").is_file():
            build_digits(digits)
        r18_manifest, digits_manifest = read_manifest(r18), read_manifest(digits)
        onnx_int8 = r18 / next(v for v in r18_manifest["variants"] if v["name"] == "onnx-int8")["file"]
        size = r18_manifest["input"]["shape"][1]
        digit_size, digit_channels = digits_manifest["input"]["shape"][1], digits_manifest["input"]["shape"][0]
        ov = openvino_variant(r18_manifest)
        all_digits = [v["name"] for v in digits_manifest["variants"] if v["status"] == "accepted"]

        configs = {"plain FastAPI + ORT (onnx-int8)": lambda port: (
                       [sys.executable, str(ROOT / "benchmarks/peers/fastapi_ort.py"), str(onnx_int8),
                        "--port", str(port), "--size", str(size)], "/health", png(size, 3)),
                   "optiserve onnx-int8": lambda port: (
                       optiserve_command(r18, port, "--variants", "onnx-int8"), "/v2/health/ready", png(size, 3))}
        if ov:
            configs[f"optiserve {ov}"] = lambda port: (
                optiserve_command(r18, port, "--variants", ov), "/v2/health/ready", png(size, 3))
        configs[f"optiserve digits folder ({len(all_digits)} variants)"] = lambda port: (
            optiserve_command(digits, port), "/v2/health/ready", png(digit_size, digit_channels))

        results: dict[str, list[tuple[float, int]]] = {name: [] for name in configs}
        print(f"CPU: {cpu_line()}; {args.rounds} rounds, each server started alone in turn", flush=True)
        for round_ in range(args.rounds):
            for name, make in configs.items():
                port = free_port()
                command, ready_path, image = make(port)
                base = f"http://127.0.0.1:{port}"
                results[name].append(start_and_measure(command, base + ready_path, base + "/predict", image))
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)

        print_table(results)
        print(f"\nDigits folder variants: {', '.join(all_digits)}")
        print("\nImport time of the serving path (optiserve.serve.app) by top-level package (s):")
        times = import_times()
        print("| package | s |\n|---|---|")
        for name, seconds in times[:12]:
            print(f"| {name} | {seconds:.3f} |")
        print(f"| (others) | {sum(s for _, s in times[12:]):.3f} |")
        print(f"| total | {sum(s for _, s in times):.3f} |")
        print(f"\nPython {sys.version.split()[0]}, {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
