"""A peer for the text serving benchmark: sentence-transformers behind FastAPI + uvicorn, as its
users serve it — one `SentenceTransformer` loaded at start, each request's texts encoded on their
own by `model.encode` in FastAPI's thread pool (no batching across requests), same /predict body
({"texts": [...]}) and answer ({"embedding": [[...], ...]}) as optiserve's, so one load generator
drives both.

Serve (the backend as sentence-transformers takes it; `--file-name` picks an exported ONNX file
inside the folder, as `model_kwargs={"file_name": ...}` does):

    python benchmarks/peers/st_fastapi.py serve FOLDER --backend onnx --file-name onnx/model_qint8_avx512_vnni.onnx --port 8300
    python benchmarks/peers/st_fastapi.py serve FOLDER --backend torch --port 8300

Export (sentence-transformers' own dynamic INT8 export; needs `optimum[onnxruntime]`, so it runs
with a virtual environment's python, see benchmarks/text_serving.py): copies FOLDER to OUT, exports
it to ONNX there (OUT/onnx/model.onnx) and writes the quantized file beside it
(OUT/onnx/model_qint8_CONFIG.onnx), CONFIG one of arm64, avx2, avx512, avx512_vnni:

    python benchmarks/peers/st_fastapi.py export FOLDER OUT --config avx512_vnni
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from pydantic import BaseModel


class Texts(BaseModel):
    texts: list[str]


def build(folder: str, backend: str, file_name: str | None):
    from fastapi import FastAPI, HTTPException
    from sentence_transformers import SentenceTransformer

    model_kwargs = {"file_name": file_name} if file_name else None
    model = SentenceTransformer(folder, backend=backend, device="cpu", model_kwargs=model_kwargs)
    model.encode(["warm up"])
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"ok": True, "backend": backend, "file": file_name}

    @app.post("/predict")
    def predict(body: Texts):  # a plain `def`: FastAPI runs it in its thread pool, one request per call
        if not body.texts:
            raise HTTPException(400, 'send {"texts": [strings]}')
        return {"embedding": model.encode(body.texts, convert_to_numpy=True).tolist()}

    return app


def export(folder: str, out: str, config: str) -> Path:
    """sentence-transformers' ONNX export of `folder` into `out` and its dynamic INT8 quantization
    for the CPU `config`; the quantized file's path relative to `out`."""
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    target = Path(out)
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(folder, target, ignore=shutil.ignore_patterns("onnx", "openvino"))
    model = SentenceTransformer(str(target), backend="onnx", device="cpu")
    model.save_pretrained(str(target))
    export_dynamic_quantized_onnx_model(model, config, str(target))
    quantized = target / "onnx" / f"model_qint8_{config}.onnx"
    if not quantized.is_file():
        raise SystemExit(f"the export wrote no {quantized}: {sorted(p.name for p in (target / 'onnx').iterdir())}")
    return quantized.relative_to(target)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("folder")
    s.add_argument("--backend", choices=("torch", "onnx", "openvino"), default="torch")
    s.add_argument("--file-name", default=None, help="the ONNX file inside FOLDER (onnx backend)")
    s.add_argument("--port", type=int, default=8300)
    e = sub.add_parser("export")
    e.add_argument("folder")
    e.add_argument("out")
    e.add_argument("--config", choices=("arm64", "avx2", "avx512", "avx512_vnni"), default="avx2")
    args = p.parse_args()
    if args.command == "export":
        print(export(args.folder, args.out, args.config))
    else:
        import uvicorn

        uvicorn.run(build(args.folder, args.backend, args.file_name), host="127.0.0.1", port=args.port,
                    log_level="warning")
