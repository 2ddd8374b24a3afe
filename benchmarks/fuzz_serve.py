"""A long fuzzing run against a real server: the hostile-request generator of the test suite
(tests/hostile_requests.py: structurally hostile JSON, multipart and binary-extension bodies),
sent N times (default 10,000) to `optiserve serve` on loopback. Every response is tallied by
status; a 5xx, or a 4xx without a JSON error, is a failure and is printed. At the end a real
request must still get the offline runtime's answer.

    python benchmarks/fuzz_serve.py                      # 10,000 requests, small_cnn (random weights)
    python benchmarks/fuzz_serve.py --requests 50000 --seed 7
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from hostile_requests import hostile_requests, send  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize  # noqa: E402
from optiserve.runtime import load_session  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "small_cnn"
        run_optimize(OptimizeConfig("small_cnn", weights="random", int8=True, out=str(folder), progress=False))
        with served(folder, "--variants", "fp32,onnx-int8", "--max-batch-size", "4", "--max-delay-ms", "1",
                    "--max-image-pixels", "1000000") as (base, proc):
            with httpx.Client(base_url=base, timeout=30) as client:
                statuses, failures, t0 = collections.Counter(), [], time.perf_counter()

                @seed(args.seed)
                @settings(max_examples=args.requests, deadline=None, database=None, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck))
                @given(hostile_requests)
                def fuzz(hostile):
                    r = send(client, hostile)
                    statuses[r.status_code] += 1
                    bad = r.status_code >= 500
                    if 400 <= r.status_code < 500:
                        try:
                            bad = not r.json().get("error")
                        except ValueError:
                            bad = True
                    if bad:
                        failures.append((hostile, r.status_code, r.text[:200]))

                fuzz()
                seconds = time.perf_counter() - t0
                manifest = read_manifest(folder)
                entry = next(v for v in manifest["variants"] if v["name"] == "onnx-int8")
                x = np.random.default_rng(0).standard_normal((3, 1, 16, 16)).astype(np.float32)
                want = load_session(folder / entry["file"], entry, manifest).run(x).argmax(1).tolist()
                r = client.post("/predict", json={"inputs": x.tolist(), "variant": "onnx-int8", "top_k": 1})
                got = [row[0]["index"] for row in r.json()["predictions"]] if r.status_code == 200 else None
            alive = proc.poll() is None
    total = sum(statuses.values())
    print(f"machine: {cpu_line()}")
    print(f"{total:,} hostile requests in {seconds:.0f} s ({total / seconds:.0f}/s), seed {args.seed}\n")
    print("| status | requests | share |\n|---:|---:|---:|")
    for status, n in sorted(statuses.items()):
        print(f"| {status} | {n:,} | {100 * n / total:.1f}% |")
    print(f"\nfailures (5xx, or 4xx without a JSON error): {len(failures)}")
    for hostile, status, text in failures[:10]:
        print(f"  {status}: {hostile!r} -> {text!r}")
    ok = got == want and alive
    print(f"afterwards: server alive {alive}; a real request answered {'as offline' if got == want else got}")
    return 0 if not failures and ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
