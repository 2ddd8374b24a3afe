"""Where a reload's stall comes from, phase by phase, without a server in the way.

Loads an artifact folder's variants as the server does (verified, loaded and warmed up on one loader
thread), serves each from a thread of its own running batches back to back (as the server's batchers
do), and keeps a thread that sleeps 1 ms at a time (as the event loop waits: how late it wakes is how
long something else held the GIL). After a quiet window it loads and warms every variant again,
`--reloads` times, each new version replacing the one served. Prints, for the quiet window and each
phase of the reloads (verify and load; warm-up), the served batches' latency and the sleeper's
lateness: a phase that holds the GIL shows in the sleeper, one that holds the device in the batches.

    python benchmarks/reload_stalls.py --artifact gpu-out/art-int8
    python benchmarks/reload_stalls.py --artifact gpu-out/art-int8 --no-jit-optimize
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.errors import UserError  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.runtime import RuntimeOptions  # noqa: E402
from optiserve.runtime.variants import load_verified, select_variants, warm_up  # noqa: E402
from optiserve.serve.model import BatchingConfig  # noqa: E402


def quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, help="artifact folder (optimize's --out)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda, as serve --device")
    p.add_argument("--variants", default=None, help="comma-separated variants (default: the accepted ones)")
    p.add_argument("--batch", type=int, default=16, help="the served batches' size")
    p.add_argument("--max-batch-size", type=int, default=32, help="the warm-up's sizes follow from it, as serve's")
    p.add_argument("--reloads", type=int, default=5)
    p.add_argument("--quiet-s", type=float, default=3.0, help="seconds served before the first reload")
    p.add_argument("--gap-s", type=float, default=0.5, help="seconds served between reloads")
    p.add_argument("--no-jit-optimize", action="store_true",
                   help="run TorchScript without its profiling executor's optimization, in every thread")
    args = p.parse_args()

    folder = Path(args.artifact)
    manifest = read_manifest(folder)
    entries = select_variants(manifest, args.variants.split(",") if args.variants else None)
    options = RuntimeOptions(device=args.device)
    shape = manifest["input"]["shape"]
    sizes = BatchingConfig(args.max_batch_size, 0.0, 64).sizes

    def thread_setup():
        if args.no_jit_optimize:
            import torch

            torch._C._set_graph_executor_optimize(False)  # thread-local in TorchScript

    loader = ThreadPoolExecutor(1, thread_name_prefix="load", initializer=thread_setup)

    def load(entry):
        t0 = time.perf_counter()
        loaded = load_verified(folder, entry, manifest, options)
        t1 = time.perf_counter()
        warm_up(loaded, shape, sizes)
        return loaded, (t0, t1, time.perf_counter())

    current = {e["name"]: loader.submit(load, e).result()[0] for e in entries}
    print(f"machine: {cpu_line()}")
    try:
        import torch

        if torch.cuda.is_available():
            print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    except ImportError:
        pass
    print(f"variants: {', '.join(f'{n} ({v.session.backend} on {v.session.device})' for n, v in current.items())}; "
          f"served batches of {args.batch}; warm-up sizes {sizes}; TorchScript optimization "
          f"{'off' if args.no_jit_optimize else 'on'}\n")

    stop = threading.Event()
    served: list[tuple[float, float]] = []  # (end, latency ms) of every served batch
    late: list[tuple[float, float]] = []    # (wake time, ms late) of the sleeper

    def serve(name):
        thread_setup()
        x = np.random.default_rng(0).standard_normal((args.batch, *shape), dtype=np.float32)
        while not stop.is_set():
            t0 = time.perf_counter()
            current[name].session.run(x)
            t1 = time.perf_counter()
            served.append((t1, (t1 - t0) * 1e3))

    def sleeper():
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            t1 = time.perf_counter()
            late.append((t1, max(0.0, (t1 - t0) * 1e3 - 1.0)))

    threads = [threading.Thread(target=serve, args=(n,), daemon=True) for n in current]
    threads.append(threading.Thread(target=sleeper, daemon=True))
    for t in threads:
        t.start()
    phases: list[tuple[str, float, float]] = []
    t_quiet = time.perf_counter()
    time.sleep(args.quiet_s)
    phases.append(("quiet", t_quiet, time.perf_counter()))
    for _ in range(args.reloads):
        for entry in entries:
            loaded, (t0, t1, t2) = loader.submit(load, entry).result()
            current[entry["name"]] = loaded  # the old version is dropped, as the server retires it
            phases += [(f"load {entry['name']}", t0, t1), (f"warm-up {entry['name']}", t1, t2)]
        t_gap = time.perf_counter()
        time.sleep(args.gap_s)
        phases.append(("between reloads", t_gap, time.perf_counter()))
    stop.set()
    for t in threads:
        t.join(timeout=10)
    loader.shutdown()

    print("| phase | time ms (median) | served batches | p50 ms | p99 ms | max ms | GIL: sleeper late, max ms | p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(n for n, _, _ in phases):
        spans = [(a, b) for n, a, b in phases if n == name]
        inside = lambda t: any(a <= t <= b for a, b in spans)  # noqa: E731
        lat = [ms for t, ms in served if inside(t)]
        gil = [ms for t, ms in late if inside(t)]
        dur = statistics.median((b - a) * 1e3 for a, b in spans)
        print(f"| {name} | {dur:.1f} | {len(lat)} | {quantile(lat, 0.5):.2f} | {quantile(lat, 0.99):.2f} | "
              f"{max(lat, default=float('nan')):.2f} | {max(gil, default=float('nan')):.2f} | {quantile(gil, 0.99):.2f} |")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:  # a folder that is not an artifact, a variant it lacks, no GPU for --device cuda
        sys.exit(f"reload_stalls.py: {e}")
