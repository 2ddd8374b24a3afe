"""What a detect -> crop -> classify pipeline costs on the server, measured side by side in one run.

The models: a detector trained here to find scikit-learn's digits pasted on a dark background
(benchmarks/digit_scenes.py), and the digits classifier (small_cnn), each optimized with --int8 and
served from one repository with a pipeline folder `reader`. The load: closed-loop callers sending
64x64 scenes of three held-out digits, in alternating rounds:

- pipeline: `/predict?model=reader`, one request per scene;
- pipeline, protocol: the Open Inference Protocol's infer on `reader`, the PNG as a BYTES tensor in
  binary data and the outputs answered as binary data (as tritonclient sends and reads them);
- client, two calls: the detector's `/predict`, the crops cut by the client, then the classifier's
  `/predict` with the crops as base64 images in one JSON request;
- detector alone: the scenes to `/predict?model=finder`;
- classifier alone: the scenes' crops (16x16 PNGs) to `/predict?model=digits`, one per request.

Prints scenes/s and crops/s per way (medians of the rounds), the pipeline against the slower step
alone (in scenes/s: the classifier's crops/s over three crops a scene) and against the bound the
two steps allow when they share this CPU (1 / (1/detector + 3/classifier)), and against the
client's two calls.

    python benchmarks/pipeline_overhead.py                 # 3 rounds of 10 s per way, 8 callers
    python benchmarks/pipeline_overhead.py --seconds 5 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from digit_scenes import MEAN, SIDE, STD, TRAIN_DIGITS, export_detector, scene, train_detector  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.serve.launch import served  # noqa: E402

PER_SCENE = 3
PNG = {"content-type": "image/png"}


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def build_repository(root: Path) -> None:
    """finder (the detector), digits (the classifier), reader (the pipeline), each optimized here."""
    from optiserve.models import InputOverrides
    from optiserve.optimize.pipeline import OptimizeConfig, run_optimize
    from optiserve.train import TrainConfig, train

    work = root.parent / f"{root.name}.work"
    work.mkdir(exist_ok=True)
    print("training the digit finder and the digits classifier ...", flush=True)
    onnx = export_detector(train_detector(steps=1500), work / "finder.onnx")
    (work / "labels.txt").write_text("digit\n")
    rng = np.random.default_rng(1)
    (work / "scenes").mkdir()
    for i in range(96):
        scene(rng, int(rng.integers(1, 4)), range(TRAIN_DIGITS)).image.save(work / "scenes" / f"{i}.png")
    run_optimize(OptimizeConfig(str(onnx), task="detection", dataset=f"imagefolder:{work / 'scenes'}", int8=True,
                                input=InputOverrides((3, SIDE, SIDE), MEAN, STD), labels=str(work / "labels.txt"),
                                accuracy_aware=False, out=str(root / "finder"), progress=False))
    checkpoint = work / "small_cnn.pt"
    train(TrainConfig(model="small_cnn", dataset="digits", epochs=8, out=str(checkpoint), progress=False))
    run_optimize(OptimizeConfig("small_cnn", weights=str(checkpoint), int8=True, search="off",
                                out=str(root / "digits"), progress=False))
    (root / "reader").mkdir()
    (root / "reader" / "pipeline.json").write_text(json.dumps(
        {"steps": [{"model": "finder"}, {"model": "digits", "crops": {"min_score": 0.5, "max_crops": 8}}]}))


async def closed_loop(callers: int, seconds: float, work) -> tuple[float, float, int]:
    """`callers` each running `work(session, i)` (returning crops read) back to back for `seconds`:
    (scenes/s, crops/s, failures)."""
    import aiohttp

    done, crops, failed = 0, 0, 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        end = time.perf_counter() + seconds

        async def caller(k: int) -> None:
            nonlocal done, crops, failed
            i = k
            while time.perf_counter() < end:
                try:
                    read = await work(session, i)  # not `crops += await ...`: that reads crops before awaiting
                    crops += read
                    done += 1
                except (AssertionError, aiohttp.ClientError, asyncio.TimeoutError):
                    failed += 1
                i += callers

        start = time.perf_counter()
        await asyncio.gather(*(caller(k) for k in range(callers)))
        elapsed = time.perf_counter() - start
    return done / elapsed, crops / elapsed, failed


def ways(base: str, scenes: list, crops: list[bytes]) -> dict:
    pngs = [_png(s.image) for s in scenes]

    async def pipeline(session, i):
        async with session.post(f"{base}/predict?model=reader", data=pngs[i % len(pngs)], headers=PNG) as r:
            assert r.status == 200
            body = await r.json()
        return sum("predictions" in b for b in body["detections"][0])

    def protocol_body(png: bytes) -> tuple[bytes, dict]:
        """The Open Inference Protocol's infer with the PNG as a BYTES tensor in binary data, as
        tritonclient sends it, asking for every output as binary data."""
        element = len(png).to_bytes(4, "little") + png
        head = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                       "parameters": {"binary_data_size": len(element)}}],
                           "parameters": {"binary_data_output": True}}).encode()
        return head + element, {"content-type": "application/octet-stream",
                                "Inference-Header-Content-Length": str(len(head))}

    bodies = [protocol_body(png) for png in pngs]

    async def protocol(session, i):
        body, headers = bodies[i % len(bodies)]
        async with session.post(f"{base}/v2/models/reader/infer", data=body, headers=headers) as r:
            assert r.status == 200
            content = await r.read()
            head = json.loads(content[:int(r.headers["Inference-Header-Content-Length"])])
        return next(o["shape"][0] for o in head["outputs"] if o["name"] == "box_index")

    async def two_calls(session, i):
        s = scenes[i % len(scenes)]
        async with session.post(f"{base}/predict?model=finder", data=pngs[i % len(pngs)], headers=PNG) as r:
            assert r.status == 200
            boxes = [b["box"] for b in (await r.json())["detections"][0] if b["score"] >= 0.5][:8]
        if not boxes:
            return 0
        cut = [base64.b64encode(_png(s.image.crop(tuple(round(v) for v in box)))).decode() for box in boxes]
        async with session.post(f"{base}/predict?model=digits", json={"inputs": cut}) as r:
            assert r.status == 200
            await r.read()
        return len(boxes)

    async def detector(session, i):
        async with session.post(f"{base}/predict?model=finder", data=pngs[i % len(pngs)], headers=PNG) as r:
            assert r.status == 200
            await r.read()
        return 0

    async def classifier(session, i):
        async with session.post(f"{base}/predict?model=digits", data=crops[i % len(crops)], headers=PNG) as r:
            assert r.status == 200
            await r.read()
        return 1

    return {"pipeline": pipeline, "pipeline, protocol (BYTES)": protocol, "client, two calls": two_calls, "detector alone": detector,
            "classifier alone": classifier}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--callers", type=int, default=8)
    p.add_argument("--repository", type=Path, help="where to build the repository (kept, and reused if there); "
                                                   "default: a temporary folder")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.repository or Path(tmp) / "models"
        if not (root / "reader").is_dir():
            root.mkdir(parents=True)
            build_repository(root)
        rng = np.random.default_rng(11)
        scenes = [scene(rng, PER_SCENE, range(TRAIN_DIGITS, 1797)) for _ in range(64)]
        crops = [_png(s.image.crop(box)) for s in scenes for box in s.boxes]
        with served(root) as (base, _):
            loads = ways(base, scenes, crops)
            for work in loads.values():  # warm every path
                asyncio.run(closed_loop(args.callers, 1.0, work))
            results: dict[str, list] = {name: [] for name in loads}
            for _ in range(args.rounds):
                for name, work in loads.items():
                    results[name].append(asyncio.run(closed_loop(args.callers, args.seconds, work)))
    median = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs),
                     sum(r[2] for r in rs)) for name, rs in results.items()}
    print(f"\nCPU: {cpu_line()}")
    print(f"scenes of {PER_SCENE} digits at {SIDE}x{SIDE}, {args.callers} closed-loop callers, medians of "
          f"{args.rounds} alternating rounds of {args.seconds:g} s\n")
    print("| way | scenes/s | crops/s | failed |")
    print("|---|---|---|---|")
    for name, (scenes_s, crops_s, failed) in median.items():
        shown = "—" if name == "detector alone" else f"{crops_s:.0f}"
        print(f"| {name} | {'—' if name == 'classifier alone' else f'{scenes_s:.0f}'} | {shown} | {failed} |")
    pipeline = median["pipeline"][0]
    detector, classifier = median["detector alone"][0], median["classifier alone"][1] / PER_SCENE
    slower = min(detector, classifier)
    shared = 1 / (1 / detector + 1 / classifier)
    print(f"\npipeline / slower step alone ({'detector' if detector < classifier else 'classifier'}, "
          f"{slower:.0f} scenes/s): {pipeline / slower:.2f}")
    print(f"pipeline / both steps sharing this CPU ({shared:.0f} scenes/s): {pipeline / shared:.2f}")
    print(f"pipeline / client's two calls: {pipeline / median['client, two calls'][0]:.2f}")
    print(f"pipeline over the protocol / over /predict: {median['pipeline, protocol (BYTES)'][0] / pipeline:.2f}")


if __name__ == "__main__":
    main()
