"""A peer for benchmarks/serve_peers.py: LitServe with its dynamic batching, over one ONNX Runtime
session. Same model file, same /predict multipart upload (field `file`) and top-5 JSON answer as
optiserve, so one load generator drives both. Needs `pip install litserve`.

    python benchmarks/peers/litserve_ort.py MODEL.onnx --port 8300 [--size 224 --max-batch-size 16]
"""

from __future__ import annotations

import argparse
import io

import litserve as ls
import numpy as np
import onnxruntime as ort
from PIL import Image

MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


class OnnxClassifier(ls.LitAPI):
    def __init__(self, model: str, size: int, **kwargs):
        super().__init__(**kwargs)
        self.model_file, self.size = model, size

    def setup(self, device):
        self.session = ort.InferenceSession(self.model_file, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def decode_request(self, request):
        upload = request["file"]
        data = upload.file.read() if hasattr(upload, "file") else upload
        size = self.size
        image = Image.open(io.BytesIO(data)).convert("RGB")
        scale = round(size * 256 / 224) / min(image.size)
        image = image.resize((max(size, round(image.width * scale)), max(size, round(image.height * scale))),
                             Image.BILINEAR)
        left, top = (image.width - size) // 2, (image.height - size) // 2
        image = image.crop((left, top, left + size, top + size))
        x = np.asarray(image, np.float32).transpose(2, 0, 1) / 255.0
        return ((x - MEAN) / STD).astype(np.float32)

    def batch(self, inputs):
        return np.stack(inputs)

    def predict(self, x):
        return self.session.run(None, {self.input_name: x})[0]

    def unbatch(self, output):
        return [(row, len(output)) for row in output]

    def encode_response(self, answer):
        logits, batch_size = answer
        e = np.exp(logits - logits.max())
        probs = e / e.sum()
        top = np.argsort(-probs)[:5]
        return {"predictions": [[{"index": int(i), "probability": float(probs[i])} for i in top]],
                "latency_ms": {"batch_sizes": [batch_size]}}  # read by the load generator, as optiserve's answer is


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--batch-timeout-ms", type=float, default=5.0)
    args = p.parse_args()
    api = OnnxClassifier(args.model, args.size, max_batch_size=args.max_batch_size,
                         batch_timeout=args.batch_timeout_ms / 1000)
    ls.LitServer(api, accelerator="cpu", workers_per_device=1).run(port=args.port, host="127.0.0.1",
                                                                   generate_client_file=False, log_level="warning")
