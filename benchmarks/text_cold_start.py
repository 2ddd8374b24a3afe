"""How fast a text model's server starts and how much memory it holds: optiserve beside a plain
FastAPI + ONNX Runtime + `tokenizers` server on the same model file and tokenizer.

Each round starts, in turn and one at a time on a quiet machine:

  - the plain peer (benchmarks/peers/fastapi_ort_text.py) on the text artifact's `onnx-int8` file;
  - `optiserve serve` on that artifact folder with `--variants onnx-int8`, and with
    `--variants openvino-int8` (where it was accepted).

"Ready" and resident memory are measured as benchmarks/cold_start.py measures them (first 200 from
the readiness endpoint, polled every 50 ms; VmRSS after 20 answered requests of 4 texts each). The
optiserve servers are ready once every batch size they form is warm at a short length
(serve/text_requests.py's warm-up) and each session has measured its cost of a run
(runtime/length_groups.py); the peer once its session is loaded. Medians over the rounds,
with the ratios to the peer (bar: ready <= 1.5x, memory <= 2x).

    python benchmarks/text_cold_start.py                    # all-MiniLM-L6-v2, built first if missing
    python benchmarks/text_cold_start.py --artifact artifacts/minilm-polarity --rounds 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from cold_start import optiserve_command, print_table, start_and_measure  # noqa: E402
from text_batching import text_artifact  # noqa: E402

from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import free_port  # noqa: E402

BODY = {"texts": ["A short sentence, as a search box sends.",
                  "Another one, a little longer than the first, about the weather and the trains.",
                  "A third.", "And a fourth text to embed, with a few more words in it than the third."]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help="a text encoder's artifact folder (default "
                                                    "artifacts/minilm-polarity, built if missing)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    folder, manifest, text_input = text_artifact(args.artifact)
    if manifest.get("task") != "text-embedding":
        raise SystemExit(f"{folder} is not a text encoder's artifact folder")
    variants = {v["name"]: v for v in manifest["variants"]}
    if "onnx-int8" not in variants:
        raise SystemExit(f"{folder} has no onnx-int8 variant (optimize it with --int8)")
    configs = {"plain FastAPI + ORT + tokenizers (onnx-int8)": lambda port: (
        [sys.executable, str(ROOT / "benchmarks/peers/fastapi_ort_text.py"), str(folder / variants["onnx-int8"]["file"]),
         str(folder / text_input.tokenizer), "--max-length", str(text_input.max_length), "--port", str(port)],
        "/health")}
    for name in ("onnx-int8", "openvino-int8"):
        if name in variants and variants[name]["status"] == "accepted":
            configs[f"optiserve {name}"] = lambda port, name=name: (
                optiserve_command(folder, port, "--variants", name), "/v2/health/ready")

    results: dict[str, list[tuple[float, int]]] = {name: [] for name in configs}
    print(f"CPU: {cpu_line()}; model {folder} (max length {text_input.max_length}); {args.rounds} rounds, each "
          f"server started alone in turn", flush=True)
    for round_ in range(args.rounds):
        for name, make in configs.items():
            port = free_port()
            command, ready_path = make(port)
            base = f"http://127.0.0.1:{port}"
            results[name].append(start_and_measure(command, base + ready_path, base + "/predict", None, body=BODY))
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)

    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
