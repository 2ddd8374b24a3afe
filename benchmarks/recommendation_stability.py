"""Can timing noise flip the recommendation? The plain fastest-median rule against runtime.fastest's.

Loads two variants of the 224x224 ResNet-18 (`artifacts/resnet18-224-random`, built by
`benchmarks/engines_vs_openvino.py` if missing; default onnx-int8 and openvino-int8, a few percent
apart) the way the optimizer does (spinning off), and decides between them `--repeats` times at
`--batch`, each from a fresh first pass of 15 interleaved rounds as `optimize` times: by the plain
rule (the lower median wins) and by the rule the optimizer and the server use (runtime.fastest:
separated by 2% with the 95% interval above 1, else re-timed, else a tie to the smaller file).
With `--busy N`, N processes spin on the CPU meanwhile, as on a shared machine. Prints each
decision and how often each rule picked each variant: a rule noise cannot flip picks one.

    python benchmarks/recommendation_stability.py
    python benchmarks/recommendation_stability.py --busy 1 --repeats 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from engines_vs_openvino import build  # noqa: E402
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.runtime import RuntimeOptions  # noqa: E402
from optiserve.runtime.fastest import choose_fastest, describe  # noqa: E402
from optiserve.runtime.timing import interleaved_times  # noqa: E402
from optiserve.runtime.variants import load_verified  # noqa: E402


def spin(stop) -> None:
    """Keep one core busy with bursts of arithmetic, as another job on a shared machine does."""
    x = np.random.default_rng(0).standard_normal((256, 256))
    while not stop.is_set():
        x = np.tanh(x @ x / 256)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help="default artifacts/resnet18-224-random (built if missing)")
    p.add_argument("--variants", default="onnx-int8,openvino-int8", help="the two variants to decide between")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU while it times")
    args = p.parse_args()
    folder = Path(args.artifact or ROOT / "artifacts" / "resnet18-224-random")
    if not (folder / "manifest.json").is_file():
        build(folder)
    manifest = read_manifest(folder)
    entries = {e["name"]: e for e in manifest["variants"]}
    names = args.variants.split(",")
    missing = [n for n in names if n not in entries]
    if len(names) != 2 or missing:
        raise SystemExit(f"give two variants of {', '.join(entries)}" + (f"; no {', '.join(missing)}" if missing else ""))
    options = RuntimeOptions(extra={"spin": False})
    sessions = {n: load_verified(folder, entries[n], manifest, options).session for n in names}
    sizes = {n: entries[n]["size_bytes"] for n in names}
    batch = np.random.default_rng(0).standard_normal((args.batch, *manifest["input"]["shape"])).astype(np.float32)

    print(f"machine: {cpu_line()}")
    print(f"{' vs '.join(names)} at batch {args.batch}, {args.repeats} decisions, {args.busy} busy process(es); "
          f"files {', '.join(f'{n} {sizes[n] / 1e6:.1f} MB' for n in names)}")
    stop = multiprocessing.Event()
    busy = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for proc in busy:
        proc.start()
    plain, ruled = Counter(), Counter()
    try:
        for i in range(args.repeats):
            times = interleaved_times(sessions, batch, rounds=15, warmup=3, max_seconds=60.0)
            medians = {n: statistics.median(t) for n, t in times.items()}
            by_median = min(medians, key=medians.get)
            choice = choose_fastest(sessions, batch, sizes, times=times, retime_rounds=30, retime_seconds=20.0)
            plain[by_median] += 1
            ruled[choice.chosen + (" (tie)" if choice.tie else "")] += 1
            print(f"{i + 1:>2}  medians {', '.join(f'{n} {m:.1f} ms' for n, m in medians.items())}  "
                  f"plain: {by_median:<14} rule: {describe(choice.to_dict())}", flush=True)
    finally:
        stop.set()
        for proc in busy:
            proc.join(5)
    print(f"\nplain rule picked: {dict(plain)}\nruntime.fastest picked: {dict(ruled)}")
    flips = lambda c: sum(c.values()) - max(c.values())  # noqa: E731
    print(f"decisions against the majority: plain {flips(plain)} of {args.repeats}, "
          f"runtime.fastest {flips(Counter(k.split()[0] for k in ruled.elements()))} of {args.repeats}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
