"""Layers point down only: cli -> train/optimize/serve/bench -> runtime -> models/data -> shared modules.
Checked on the imports every module really makes (parsed, so lazy imports inside functions count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "optiserve"

# what each layer must never import (module prefixes)
FORBIDDEN = {
    "serve": ("optiserve.optimize", "optiserve.train", "optiserve.bench", "optiserve.cli"),
    "bench": ("optiserve.serve", "optiserve.optimize", "optiserve.train", "optiserve.cli"),
    # the optimizer may fine-tune a pruned model with the trainer: the one sideways import allowed
    "optimize": ("optiserve.serve", "optiserve.bench", "optiserve.cli"),
    "train": ("optiserve.serve", "optiserve.bench", "optiserve.optimize", "optiserve.cli"),
    "runtime": ("optiserve.serve", "optiserve.bench", "optiserve.optimize", "optiserve.train", "optiserve.cli"),
    # tasks say what an output means to the optimizer and the server: numpy only, below both
    "tasks": ("optiserve.runtime", "optiserve.serve", "optiserve.bench", "optiserve.optimize", "optiserve.train",
              "optiserve.models", "optiserve.data", "optiserve.cli"),
    "models": ("optiserve.runtime", "optiserve.serve", "optiserve.bench", "optiserve.optimize", "optiserve.train"),
    # the gRPC messages are shared by the server and the load generator: below both
    "grpc_protocol": ("optiserve.runtime", "optiserve.serve", "optiserve.bench", "optiserve.optimize",
                      "optiserve.train", "optiserve.cli"),
    "data": ("optiserve.runtime", "optiserve.serve", "optiserve.bench", "optiserve.optimize", "optiserve.train"),
}
# what bench may take from serving: the response header that says which variant answered, and the
# launcher that runs `optiserve serve` as a child process for the tuner (a server driven from outside)
ALLOWED = {("bench", "optiserve.serve", "VARIANT_HEADER"), ("bench", "optiserve.serve.launch", "served")}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.module, alias.name


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(layer):
    offences = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for module, name in _imports(path):
            if (layer, module, name) in ALLOWED:
                continue
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[layer]):
                offences.append(f"{path.relative_to(PACKAGE.parent)} imports {module}{'.' + name if name else ''}")
    assert not offences, "\n".join(offences)


def test_the_artifact_folder_format_is_read_from_below_the_layers_that_use_it():
    readers = [p for layer in ("serve", "bench", "runtime") for p in (PACKAGE / layer).rglob("*.py")
               if any(m == "optiserve.artifacts" for m, _ in _imports(p))]
    assert readers, "serve, bench and runtime read artifact folders through optiserve.artifacts"


def test_the_server_and_the_load_generator_start_without_torch():
    """Serving ONNX Runtime and OpenVINO variants and `optiserve serve`/`bench` themselves import no
    torch, torchvision or scikit-learn (seconds of start-up; a serving image may lack them): the torch
    backends and the dataset loaders are imported when a torch variant or a dataset is loaded. The
    load client sends a text file's texts or the digits without them too."""
    import subprocess
    import sys

    code = ("import sys, optiserve.cli as cli, optiserve.serve.app, optiserve.serve.grpc_service, "
            "optiserve.serve.ray_deployment, optiserve.bench.command, optiserve.bench.http, optiserve.bench.texts; "
            "from optiserve.bench.payloads import dataset_images; assert len(dataset_images('digits', count=2)) == 2; "
            "cli.build_parser(['serve']); cli.build_parser(['bench']); "
            "print(sorted(m for m in ('torch', 'torchvision', 'sklearn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_torchscript_variant_loads_without_the_model_registry_or_torchvision(tmp_path):
    """A TorchScript (or TensorRT) file is loaded by torch alone: the model registry, and the
    torchvision it imports (with torch._dynamo, sympy and triton: seconds of a start), are imported
    for an eager variant only, which rebuilds its module from the registry."""
    import subprocess
    import sys

    code = ("import sys, numpy as np, torch\n"
            "from optiserve.runtime import load_session\n"
            f"path = {str(tmp_path / 'm.pt')!r}\n"
            "torch.jit.save(torch.jit.script(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))), path)\n"
            "session = load_session(path, {'name': 'torchscript', 'backend': 'torchscript'}, {})\n"
            "assert session.run(np.zeros((2, 1, 4, 4), np.float32)).shape == (2, 3)\n"
            "print(sorted(m for m in ('torchvision', 'optiserve.models', 'torch._dynamo', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]", out.stdout
