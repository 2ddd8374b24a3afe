"""A peer for the text benchmarks: the text server a user writes by hand — FastAPI, `tokenizers`, one
ONNX Runtime session, each request tokenized and run on its own. Same model file and tokenizer as an
optiserve text artifact, same /predict body ({"texts": [...]}) and answer shape ({"embedding": [...]}
for an encoder's vectors), so one load generator drives both.

    python benchmarks/peers/fastapi_ort_text.py MODEL.onnx TOKENIZER.json --max-length 256 --port 8200
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from tokenizers import Tokenizer


def build(model: str, tokenizer_file: str, max_length: int) -> FastAPI:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]
    tokenizer = Tokenizer.from_file(tokenizer_file)
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding()
    app = FastAPI()

    def embed(texts: list[str]) -> np.ndarray:
        encodings = tokenizer.encode_batch(texts)
        given = {"input_ids": [e.ids for e in encodings], "attention_mask": [e.attention_mask for e in encodings],
                 "token_type_ids": [e.type_ids for e in encodings]}
        return session.run(None, {name: np.asarray(given[name], dtype=np.int64) for name in inputs})[0]

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.post("/predict")
    async def predict(request: Request):
        body = await request.json()
        texts = body.get("texts") if isinstance(body, dict) else None
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise HTTPException(400, 'send {"texts": [strings]}')
        vectors = await run_in_threadpool(embed, texts)
        return {"embedding": vectors.tolist()}

    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("tokenizer")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--port", type=int, default=8200)
    args = p.parse_args()
    uvicorn.run(build(args.model, args.tokenizer, args.max_length), host="127.0.0.1", port=args.port,
                log_level="warning")
