"""The Open Inference Protocol's gRPC messages and methods (KServe v2 `inference.GRPCInferenceService`),
from the vendored `grpc_predict_v2.proto`, for the server and the load generator alike.

The messages are built from the compiled descriptor in a pool of their own: no generated code
pinned to one protobuf release, and no clash with tritonclient's definitions of the same names
(`inference.ModelInferRequest`, ...) when both are imported in one process.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "inference.GRPCInferenceService"
DESCRIPTOR_FILE = Path(__file__).resolve().parent / "grpc_predict_v2.pb"


def _load():
    files = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_FILE.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for f in files.file:
        pool.Add(f)
    service = pool.FindServiceByName(SERVICE)
    messages = {m.name: message_factory.GetMessageClass(m)
                for f in files.file for m in pool.FindFileByName(f.name).message_types_by_name.values()}
    methods = {m.name: (message_factory.GetMessageClass(m.input_type), message_factory.GetMessageClass(m.output_type))
               for m in service.methods}
    return SimpleNamespace(**messages), methods


pb, METHODS = _load()
"""`pb.ModelInferRequest`, `pb.InferParameter`, ...; METHODS: RPC name -> (request class, response class)."""


def method_path(name: str) -> str:
    """The HTTP/2 path of an RPC, e.g. /inference.GRPCInferenceService/ModelInfer."""
    return f"/{SERVICE}/{name}"


def stub(channel) -> SimpleNamespace:
    """Callables for every RPC on a grpc (or grpc.aio) channel: `stub(channel).ModelInfer(request, timeout=...)`."""
    return SimpleNamespace(**{name: channel.unary_unary(method_path(name), request_serializer=req.SerializeToString,
                                                        response_deserializer=resp.FromString)
                              for name, (req, resp) in METHODS.items()})
