"""The input tensor the Open Inference Protocol takes for a model, and how it becomes what the
variants take (float32 [N, C, H, W]).

For most models the two are the same: FP32 [N, C, H, W] (FP16 and FP64 are taken too, and cast).
Where `optimize` adapted a foreign ONNX file's input inside its graph (models.onnx_adapt: channels
last, uint8 or float16 fed through a Transpose and a Cast), the protocol still takes the tensor the
file itself declares — `UINT8 [N, 96, 96, 3]` for a Keras-style classifier — and only that, as Triton
would serve the file; the model's metadata declares it. It is brought to the variants' input by the
inverse of the adaptation: channels last to first, and the values cast to float32 as they are (the
adapter casts them back — uint8 after rounding and clamping, which exact pixel values pass
unchanged — and scales nothing), so every variant sees what the file would have. HTTP
(envelope.infer_request) and gRPC (grpc_service.parse_infer) both read their input through here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from optiserve.input_spec import InputSpec
from optiserve.serve.binary import DTYPES
from optiserve.serve.preprocess import BadInput, tensor_batch

# the element types an adapted input may have (models.onnx_file.INPUT_DTYPES), as the protocol names them
ADAPTED_DATATYPES = {"float32": "FP32", "float16": "FP16", "uint8": "UINT8"}
NUMPY_TYPES = {**DTYPES, "UINT8": np.uint8}
INTEGER_RANGES = {"UINT8": (0, 255)}


@dataclass(frozen=True)
class ProtocolInput:
    """What a model's protocol input is: `name` (the model file's, shown in metadata; the server
    reads whatever name a request gives), `datatype` the one element type taken (None: FP32, or
    FP16/FP64), `layout` the order of one image's axes ("NCHW" or "NHWC"), the sizes from `spec`."""

    spec: InputSpec
    datatype: str | None = None
    layout: str = "NCHW"
    name: str = "input"

    @classmethod
    def of(cls, manifest: dict, spec: InputSpec) -> ProtocolInput:
        """The input a model's manifest says the protocol takes: the file's own where optimize
        adapted it (`source.input_adapted`), else float32 [N, C, H, W]."""
        name = manifest.get("input_name", "input")
        adapted = (manifest.get("source") or {}).get("input_adapted")
        if not adapted:
            return cls(spec, name=name)
        return cls(spec, ADAPTED_DATATYPES[adapted["dtype"]], adapted["layout"], name)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """One image's sizes in the order the tensor holds them."""
        c, h, w = self.spec.shape
        return (h, w, c) if self.layout == "NHWC" else (c, h, w)

    def metadata(self) -> dict:
        """The input as model metadata declares it (-1: any batch size)."""
        return {"name": self.name, "datatype": self.datatype or "FP32", "shape": [-1, *self.image_shape]}

    def described(self) -> str:
        return f"{self.datatype or 'FP32'} [N, {', '.join(map(str, self.image_shape))}]"

    def dtype(self, datatype) -> np.dtype:
        """The little-endian element type of a tensor declared `datatype`; BadInput for one the
        model does not take."""
        if self.datatype is None:
            if not isinstance(datatype, str) or datatype not in DTYPES:
                raise BadInput(f"input datatype {_show(datatype)} is not supported; send FP32 (or FP16/FP64)")
        elif datatype != self.datatype:
            raise BadInput(f"input datatype {_show(datatype)} is not what this model takes; send "
                           f"{self.described()}, the input its model file declares")
        return np.dtype(NUMPY_TYPES[datatype]).newbyteorder("<")

    def values(self, data, datatype: str, where: str) -> np.ndarray:
        """Numbers sent as JSON or typed gRPC contents (`where` the request says them) as a flat array
        of `datatype`'s element type; an integer type's must be whole and within its range, not
        wrapped or truncated into it."""
        dtype = self.dtype(datatype)
        if datatype not in INTEGER_RANGES:
            return np.asarray(data, dtype=dtype).reshape(-1)
        low, high = INTEGER_RANGES[datatype]
        numbers = np.asarray(data, dtype=np.float64).reshape(-1)
        if numbers.size and not (np.all(numbers == np.round(numbers)) and numbers.min() >= low
                                 and numbers.max() <= high):
            raise BadInput(f"{where} of a {datatype} input must be whole numbers from {low} to {high}")
        return numbers.astype(dtype)

    def batch(self, tensor: np.ndarray) -> np.ndarray:
        """A received tensor of shape [N, *image_shape] (or one image), checked, as the variants'
        input: float32 [N, C, H, W], finite."""
        if self.layout == "NCHW":
            return tensor_batch(tensor, self.spec)
        if tensor.ndim == 3:
            tensor = tensor[None]
        if tensor.ndim != 4 or tuple(tensor.shape[1:]) != self.image_shape:
            raise BadInput(f"input shape {list(tensor.shape)} is not what this model takes; send "
                           f"{self.described()}, the input its model file declares")
        return tensor_batch(np.ascontiguousarray(tensor.transpose(0, 3, 1, 2), dtype=np.float32), self.spec)


def _show(value) -> str:
    text = type(value).__name__ if isinstance(value, (list, dict)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
