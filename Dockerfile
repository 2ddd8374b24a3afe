# GPU image for optiserve: CUDA runtime, the package with the TensorRT extra.
# Build: docker build -t optiserve .
# Run:   docker run --gpus all -p 8000:8000 -v $PWD/artifacts/resnet18-digits:/artifacts optiserve
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY pyproject.toml README.md ./
COPY optiserve ./optiserve
# ONNX Runtime here is the CPU build: the ONNX variants run on the CPU, the PyTorch and TensorRT
# variants on the GPU (onnxruntime-gpu cannot be installed beside onnxruntime: same module).
RUN pip install ".[all,tensorrt]" && useradd --uid 1000 --create-home optiserve
USER 1000
WORKDIR /home/optiserve

# Ready means loaded and warm, and not draining after a SIGTERM (Kubernetes uses its own probes).
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=2)"]
EXPOSE 8000
ENTRYPOINT ["optiserve"]
# Serves the artifact folder mounted at /artifacts (written by `optimize`); any other subcommand
# works too, e.g. `docker run --gpus all optiserve train resnet18 --dataset digits`.
CMD ["serve", "/artifacts", "--host", "0.0.0.0", "--port", "8000"]
