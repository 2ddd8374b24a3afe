"""Does a variant's timing depend on its neighbours? The runtime layer's loop, checked.

Loads the 224x224 ResNet-18 variants (`artifacts/resnet18-224-random`, built by
`benchmarks/engines_vs_openvino.py` if missing) the way `bench engine` does (spinning off), then
times one variant (default `onnx-int8`) at batch 1 and 16 in three arrangements, alternated for
`--repeats` rounds: alone, first in an interleaved round with every other variant, and last in
it. Prints the medians and the ratios to "alone" (target: within 10%).

    python benchmarks/timing_neighbours.py
    python benchmarks/timing_neighbours.py --variant torch-int8 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from engines_vs_openvino import SKIP, build  # noqa: E402
from optiserve.artifacts import read_manifest  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.runtime import RuntimeOptions  # noqa: E402
from optiserve.runtime.timing import interleaved_times  # noqa: E402
from optiserve.runtime.variants import load_verified  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help="default artifacts/resnet18-224-random (built if missing)")
    p.add_argument("--variant", default="onnx-int8")
    p.add_argument("--repeats", type=int, default=5, help="alternations of the three arrangements")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per arrangement")
    p.add_argument("--spin", action="store_true",
                   help="load ONNX Runtime sessions with spinning on (as before the timing loop was shared), "
                        "to see what idle spinning neighbours cost")
    args = p.parse_args()
    folder = Path(args.artifact or ROOT / "artifacts" / "resnet18-224-random")
    if not (folder / "manifest.json").is_file():
        build(folder)
    manifest = read_manifest(folder)
    options = RuntimeOptions(extra={"spin": args.spin})
    sessions = {e["name"]: load_verified(folder, e, manifest, options).session
                for e in manifest["variants"] if e["name"] not in SKIP}
    if args.variant not in sessions:
        raise SystemExit(f"no variant {args.variant!r}; there are {', '.join(sessions)}")
    target = sessions[args.variant]
    others = {n: s for n, s in sessions.items() if n != args.variant}
    arrangements = {"alone": {args.variant: target},
                    "first": {args.variant: target, **others},
                    "last": {**others, args.variant: target}}
    shape = manifest["input"]["shape"]
    print(f"machine: {cpu_line()}")
    print(f"{args.variant} timed alone, first and last among {len(others)} other loaded variants "
          f"({', '.join(others)}); {args.repeats} alternations x {args.rounds} rounds; ONNX Runtime "
          f"spinning {'on' if args.spin else 'off'}\n")
    print("| batch | alone ms | first ms | last ms | first / alone | last / alone |")
    print("|---|---|---|---|---|---|")
    worst = 1.0
    for b in (1, 16):
        x = np.random.default_rng(0).standard_normal((b, *shape), dtype=np.float32)
        times = {a: [] for a in arrangements}
        for _ in range(args.repeats):
            for name, group in arrangements.items():
                times[name] += interleaved_times(group, x, args.rounds, calls_per_round=1 if b > 1 else 5)[args.variant]
        med = {a: statistics.median(t) for a, t in times.items()}
        r1, r2 = med["first"] / med["alone"], med["last"] / med["alone"]
        worst = max(worst, r1, 1 / r1, r2, 1 / r2)
        print(f"| {b} | {med['alone']:.2f} | {med['first']:.2f} | {med['last']:.2f} | {r1:.3f} | {r2:.3f} |")
    print(f"\nlargest departure from 'alone': {100 * (worst - 1):.1f}% (target under 10%)")
    return 0 if worst < 1.10 else 1


if __name__ == "__main__":
    sys.exit(main())
