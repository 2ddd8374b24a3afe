#!/usr/bin/env bash
# Runs every GPU path of optiserve once on a machine with a CUDA GPU and says, step by step, what
# happened: training on CUDA (one process, then torchrun with NCCL and SyncBatchNorm), optimize
# --device cuda (and --tensorrt --fp16, which needs torch-tensorrt), bench engine on CUDA, and
# serve --device cuda answering /predict, the protocol's infer and a short load; a detector
# optimized and served on CUDA, and a detect -> crop -> classify pipeline of it and the classifier. A step that
# fails is reported and the next one still runs; the exit status counts the failed steps.
#
# Then a model repository on CUDA: load/unload cycles (GPU memory must come back), the measured
# default variant, the reload benchmark and where a reload's stall comes from, and the shadow benchmark.
#
#   bash benchmarks/gpu_paths.sh [WORKDIR]       (default: gpu-out; logs land there)
#   STEPS='train-cuda|optimize-cuda-int8|serve-cuda-repository' bash benchmarks/gpu_paths.sh   (only those)
set -uo pipefail
W=${1:-gpu-out}
mkdir -p "$W"
PY=${PYTHON:-python3}
failed=0
STEPS=${STEPS:-.}
step() {  # step NAME COMMAND...: run it, keep its log, print one line with the outcome and time
    local name=$1; shift
    [[ $STEPS == . || $name =~ ^($STEPS)$ ]] || return 0
    local t0=$SECONDS
    if "$@" >"$W/$name.log" 2>&1; then
        echo "PASS  $name ($((SECONDS - t0)) s)"
    else
        echo "FAIL  $name ($((SECONDS - t0)) s, exit $?) -- last lines of $W/$name.log:"
        tail -n 15 "$W/$name.log" | sed 's/^/      /'
        failed=$((failed + 1))
    fi
}

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
$PY - <<'EOF'
import torch, platform
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"available {torch.cuda.is_available()}, bf16 {torch.cuda.is_available() and torch.cuda.is_bf16_supported()}")
for name in ("onnxruntime", "torch_tensorrt", "tensorrt"):
    try:
        m = __import__(name)
        extra = f", providers {m.get_available_providers()}" if name == "onnxruntime" else ""
        print(f"{name} {m.__version__}{extra}")
    except Exception as e:
        print(f"{name}: not importable ({type(e).__name__}: {e})")
EOF

echo "== steps"
step train-cuda $PY -m optiserve train resnet18 --dataset digits --device cuda --out "$W/ckpt.pt" --no-progress
step train-torchrun-nccl-syncbn torchrun --standalone --nproc_per_node=1 -m optiserve train resnet18 --dataset digits \
    --device cuda --sync-bn --epochs 2 --out "$W/ddp.pt" --no-progress
# ONNX variants on CUDA need onnxruntime-gpu; without it --no-onnx leaves the torch variants.
onnx=--onnx
$PY -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" \
    || { onnx=--no-onnx; echo "      (onnxruntime has no CUDA provider here: optimizing with --no-onnx)"; }
step optimize-cuda $PY -m optiserve optimize resnet18 --weights "$W/ckpt.pt" $onnx --device cuda \
    --out "$W/art" --no-progress
step optimize-cuda-int8 $PY -m optiserve optimize resnet18 --weights "$W/ckpt.pt" $onnx --int8 --device cuda \
    --out "$W/art-int8" --no-progress
step detect-pipeline-cuda $PY benchmarks/gpu_detection_pipeline.py "$W/art-int8" "$W/det" --device cuda
step optimize-tensorrt $PY -m optiserve optimize resnet18 --weights "$W/ckpt.pt" --tensorrt --fp16 --device cuda \
    --out "$W/art-trt" --no-progress
step bench-engine-cuda $PY -m optiserve bench engine "$W/art" --device cuda --batch-sizes 1,32 --duration 2 \
    --out "$W/engine.json" --quiet
step serve-cuda $PY - "$W" <<'EOF'
import io, json, sys
import httpx, numpy as np
from PIL import Image
from optiserve.serve.launch import served

art = f"{sys.argv[1]}/art-int8"
manifest = json.load(open(f"{art}/manifest.json"))
names = [v["name"] for v in manifest["variants"]]
with served(art, "--device", "cuda", "--variants", ",".join(names)) as (base, proc):
    png = io.BytesIO()
    Image.fromarray((np.random.default_rng(0).random((16, 16)) * 255).astype(np.uint8)).save(png, "PNG")
    for name in names:
        r = httpx.post(f"{base}/predict", params={"variant": name}, files={"file": ("d.png", png.getvalue(), "image/png")})
        print(name, r.status_code, r.json())
        assert r.status_code == 200, r.text
    x = np.zeros((2, 1, 16, 16), np.float32)
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    r = httpx.post(f"{base}/v2/models/{manifest['model']}/infer", json=body)
    print("infer", r.status_code, str(r.json())[:200])
    assert r.status_code == 200, r.text
EOF
step serve-cuda-load bash -c "
  $PY -m optiserve serve '$W/art' --device cuda --port 8321 > '$W/server.log' 2>&1 & pid=\$!
  for i in \$(seq 600); do curl -sf http://127.0.0.1:8321/v2/health/ready >/dev/null && break; kill -0 \$pid || exit 1; sleep 0.2; done
  $PY -m optiserve bench http http://127.0.0.1:8321 --concurrency 1,32 --duration 5 --warmup 2 --out '$W/http.json' --quiet
  rc=\$?; curl -s http://127.0.0.1:8321/stats > '$W/stats.json'; kill \$pid; wait \$pid; exit \$rc"

step serve-cuda-repository $PY - "$W" <<'EOF'
import json, shutil, subprocess, sys, tempfile
from pathlib import Path
import httpx, numpy as np
from optiserve.serve.launch import served

art = Path(sys.argv[1]) / "art-int8"
tmp = Path(tempfile.mkdtemp())
repo = tmp / "models"
for name in ("digits-a", "digits-b"):
    shutil.copytree(art, repo / name)
(tmp / "token").write_text("gpu-paths-admin-token-0123456789")
auth = {"Authorization": "Bearer gpu-paths-admin-token-0123456789"}
x = np.zeros((1, 1, 16, 16)).tolist()

def gpu_mib(pid):
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return sum(int(m) for p, m in (l.split(", ") for l in out.strip().splitlines() if l) if int(p) == pid)

with served(repo, "--device", "cuda", "--model-control", "explicit", "--load-model", "digits-a",
            "--admin-token-file", str(tmp / "token")) as (base, proc):
    stats = httpx.get(f"{base}/stats").json()["models"]["digits-a"]
    print("default choice on cuda:", json.dumps(stats["default_choice"]))
    print("backends:", {n: v.get("backend") for n, v in stats["variants"].items()})
    used = []
    for i in range(5):
        assert httpx.post(f"{base}/v2/repository/models/digits-b/load", headers=auth, timeout=300).status_code == 200
        r = httpx.post(f"{base}/predict", params={"model": "digits-b"}, json={"inputs": x})
        assert r.status_code == 200, r.text
        loaded = gpu_mib(proc.pid)
        assert httpx.post(f"{base}/v2/repository/models/digits-b/unload", headers=auth, timeout=300).status_code == 200
        used.append(gpu_mib(proc.pid))
        print(f"cycle {i + 1}: GPU MiB with digits-b loaded {loaded}, after unload {used[-1]}")
    assert max(used) <= 1.10 * used[0], used
    for i in range(3):
        assert httpx.post(f"{base}/v2/repository/models/digits-a/load", headers=auth, timeout=300).status_code == 200
        assert httpx.post(f"{base}/predict", params={"model": "digits-a"}, json={"inputs": x}).status_code == 200
    print("index:", httpx.post(f"{base}/v2/repository/index", headers=auth).json())
EOF
step serve-reload-cuda $PY benchmarks/serve_reload.py --artifact "$W/art-int8" --duration 8 --rounds 1
step reload-stalls-cuda $PY benchmarks/reload_stalls.py --artifact "$W/art-int8" --device cuda
step serve-shadow-cuda $PY benchmarks/serve_shadow.py --artifact "$W/art-int8" --shadow torch-int8 --duration 6 --rounds 1

echo "== results"
for f in "$W/art/report.md" "$W/art-int8/report.md"; do [ -f "$f" ] && sed -n '1,40p' "$f"; done
[ -f "$W/engine.json" ] && $PY -m optiserve compare "$W/engine.json" --out "$W/report-engine" >/dev/null 2>&1 \
    && sed -n '1,40p' "$W/report-engine/report.md"
grep -h "epoch" "$W/train-cuda.log" | tail -n 3
grep -h -i "nccl\|world\|epoch" "$W/train-torchrun-nccl-syncbn.log" | tail -n 4
echo "$failed step(s) failed"
exit "$failed"
