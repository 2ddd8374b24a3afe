"""A peer for benchmarks/serve_peers.py: the server a user writes by hand — FastAPI, one ONNX Runtime
session, every request decoded and run on its own (batch 1). Same model file, same /predict
multipart upload (field `file`) and the same top-5 JSON answer as optiserve, so one load
generator drives both.

    python benchmarks/peers/fastapi_ort.py MODEL.onnx --port 8200 [--size 224]
"""

from __future__ import annotations

import argparse
import io

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI, File, UploadFile
from fastapi.concurrency import run_in_threadpool
from PIL import Image

MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


def build(model: str, size: int) -> FastAPI:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    app = FastAPI()

    def preprocess(data: bytes) -> np.ndarray:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        short = round(size * 256 / 224)
        scale = short / min(image.size)
        image = image.resize((max(size, round(image.width * scale)), max(size, round(image.height * scale))),
                             Image.BILINEAR)
        left, top = (image.width - size) // 2, (image.height - size) // 2
        image = image.crop((left, top, left + size, top + size))
        x = np.asarray(image, np.float32).transpose(2, 0, 1) / 255.0
        return ((x - MEAN) / STD)[None].astype(np.float32)

    def infer(data: bytes) -> np.ndarray:
        return session.run(None, {name: preprocess(data)})[0][0]

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.post("/predict")
    async def predict(file: UploadFile = File(...)):
        logits = await run_in_threadpool(infer, await file.read())
        e = np.exp(logits - logits.max())
        probs = e / e.sum()
        top = np.argsort(-probs)[:5]
        return {"predictions": [[{"index": int(i), "probability": float(probs[i])} for i in top]],
                "latency_ms": {"batch_sizes": [1]}}  # read by the load generator, as optiserve's answer is

    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--size", type=int, default=224)
    args = p.parse_args()
    uvicorn.run(build(args.model, args.size), host="127.0.0.1", port=args.port, log_level="warning")
