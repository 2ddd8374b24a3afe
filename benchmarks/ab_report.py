"""The README's walkthrough, end to end: optimize -> serve -> bench -> compare.

Runs the same commands the README shows, as a user would type them: builds the digits ResNet-18
artifacts when they are missing (`optimize resnet18 --int8`), starts `optiserve serve` with fp32
and onnx-int8 side by side, times both offline (`bench engine`) and over HTTP (`bench http`,
closed and open loop), and writes the A/B report (`compare`) whose excerpt and plots the README
quotes.

    python benchmarks/ab_report.py                       # report in docs/report-example/
    python benchmarks/ab_report.py --out /tmp/report --duration 5
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from optiserve.serve.launch import served  # noqa: E402


def sh(command: str, cwd: Path) -> None:
    print(f"$ {command}", flush=True)
    subprocess.run([sys.executable, "-m", "optiserve", *shlex.split(command)[1:]] if command.startswith("optiserve")
                   else shlex.split(command), cwd=cwd, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", default="artifacts/resnet18-digits")
    p.add_argument("--out", default="docs/report-example")
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per load setting")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args()

    artifacts = ROOT / args.artifacts
    if not (artifacts / "manifest.json").is_file():
        sh("optimize resnet18 --int8", ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with served(artifacts, "--variants", "fp32,onnx-int8", port=args.port) as (url, _):
            d = f"{args.duration:g}"
            sh(f"optiserve bench engine {artifacts} --variants fp32,onnx-int8 --batch-sizes 1,8,32 --duration {d} "
               f"--out {tmp}/engine.json --quiet", ROOT)
            sh(f"optiserve bench http {url} --variants fp32,onnx-int8 --concurrency 1,8,32 --rate 100 "
               f"--duration {d} --out {tmp}/http.json --quiet", ROOT)
        sh(f"optiserve compare {tmp}/engine.json {tmp}/http.json --baseline fp32 --out {ROOT / args.out}", ROOT)


if __name__ == "__main__":
    main()
