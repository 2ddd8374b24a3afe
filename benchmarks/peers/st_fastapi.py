"""A peer for the text serving benchmark: sentence-transformers behind FastAPI + uvicorn, as its
users serve it — one `SentenceTransformer` loaded at start, each request's texts encoded on their
own by `model.encode` in FastAPI's thread pool (no batching across requests), same /predict body
({"texts": [...]}) and answer ({"embedding": [[...], ...]}) as optiserve's, so one load generator
drives both.

Serve (the backend as sentence-transformers takes it; `--file-name` picks an exported ONNX file
inside the folder, as `model_kwargs={"file_name": ...}` does):

    python benchmarks/peers/st_fastapi.py serve FOLDER --backend onnx --file-name onnx/model_qint8_avx512_vnni.onnx --port 8300
    python benchmarks/peers/st_fastapi.py serve FOLDER --backend openvino --file-name openvino/openvino_model_qint8_quantized.xml --serial
    python benchmarks/peers/st_fastapi.py serve FOLDER --backend torch --port 8300

`--serial` encodes one request at a time (a lock around `model.encode`), which the openvino backend
needs: its model holds one OpenVINO infer request, and a second `encode` while one runs fails with
"RuntimeError: Infer Request is busy" (a 500 for every request but one under concurrent load).

Export (sentence-transformers' own INT8 exports, run with a virtual environment's python, see
benchmarks/text_serving.py): copies FOLDER to OUT and exports it there. `--format onnx` (needs
`optimum[onnxruntime]`): ONNX (OUT/onnx/model.onnx) and its dynamic INT8 quantization for the CPU
CONFIG (arm64, avx2, avx512 or avx512_vnni), OUT/onnx/model_qint8_CONFIG.onnx. `--format openvino`
(needs `optimum-intel[openvino,nncf]` and `datasets`): OpenVINO IR and its static INT8
quantization, calibrated on the texts of CALIBRATION (one a line; sentence-transformers' default
calibration set is glue/sst2 from the Hugging Face Hub), OUT/openvino/openvino_model_qint8_quantized.xml:

    python benchmarks/peers/st_fastapi.py export FOLDER OUT --format onnx --config avx512_vnni
    python benchmarks/peers/st_fastapi.py export FOLDER OUT --format openvino --calibration texts.txt
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from pydantic import BaseModel


class Texts(BaseModel):
    texts: list[str]


def build(folder: str, backend: str, file_name: str | None, serial: bool = False):
    import contextlib
    import threading

    from fastapi import FastAPI, HTTPException
    from sentence_transformers import SentenceTransformer

    model_kwargs = {"file_name": file_name} if file_name else None
    model = SentenceTransformer(folder, backend=backend, device="cpu", model_kwargs=model_kwargs)
    model.encode(["warm up"])
    lock = threading.Lock() if serial else contextlib.nullcontext()
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"ok": True, "backend": backend, "file": file_name, "serial": serial}

    @app.post("/predict")
    def predict(body: Texts):  # a plain `def`: FastAPI runs it in its thread pool, one request per call
        if not body.texts:
            raise HTTPException(400, 'send {"texts": [strings]}')
        with lock:
            vectors = model.encode(body.texts, convert_to_numpy=True)
        return {"embedding": vectors.tolist()}

    return app


def export(folder: str, out: str, form: str, config: str, calibration: str | None) -> Path:
    """sentence-transformers' export of `folder` into `out` in `form` (onnx: dynamic INT8 for the CPU
    `config`; openvino: static INT8 calibrated on the lines of `calibration`); the quantized file's
    path relative to `out`."""
    import sentence_transformers as st

    target = Path(out)
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(folder, target, ignore=shutil.ignore_patterns("onnx", "openvino"))
    model = st.SentenceTransformer(str(target), backend=form, device="cpu")
    model.save_pretrained(str(target))
    if form == "onnx":
        st.export_dynamic_quantized_onnx_model(model, config, str(target))
        quantized = target / "onnx" / f"model_qint8_{config}.onnx"
    else:
        import tempfile

        from optimum.intel import OVQuantizationConfig

        texts = [line for line in Path(calibration).read_text(encoding="utf-8").splitlines() if line.strip()]
        with tempfile.TemporaryDirectory() as data:  # a local folder `datasets.load_dataset` reads as a text set
            (Path(data) / "train.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
            st.export_static_quantized_openvino_model(
                model, OVQuantizationConfig(num_samples=min(300, len(texts))), str(target), dataset_name=data,
                dataset_config_name="default", dataset_split="train", column_name="text")
        quantized = target / "openvino" / "openvino_model_qint8_quantized.xml"
    if not quantized.is_file():
        raise SystemExit(f"the export wrote no {quantized}")
    return quantized.relative_to(target)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("folder")
    s.add_argument("--backend", choices=("torch", "onnx", "openvino"), default="torch")
    s.add_argument("--file-name", default=None, help="the model file inside FOLDER (onnx and openvino backends)")
    s.add_argument("--port", type=int, default=8300)
    s.add_argument("--serial", action="store_true", help="one request encoded at a time (the openvino backend's need)")
    e = sub.add_parser("export")
    e.add_argument("folder")
    e.add_argument("out")
    e.add_argument("--format", choices=("onnx", "openvino"), default="onnx")
    e.add_argument("--config", choices=("arm64", "avx2", "avx512", "avx512_vnni"), default="avx2",
                   help="the onnx format's quantization config")
    e.add_argument("--calibration", default=None, help="the openvino format's calibration texts, one a line")
    args = p.parse_args()
    if args.command == "export":
        if args.format == "openvino" and not args.calibration:
            p.error("--format openvino needs --calibration")
        print(export(args.folder, args.out, args.format, args.config, args.calibration))
    else:
        import uvicorn

        uvicorn.run(build(args.folder, args.backend, args.file_name, args.serial), host="127.0.0.1", port=args.port,
                    log_level="warning")
