"""What one `optimize` run is asked to do: the model, its weights and data, the passes and their
options, the gate's limits; checked in one place before any work starts."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from optiserve.errors import UserError
from optiserve.models import InputOverrides, find_source, model_slug
from optiserve.models.onnx_file import is_onnx_file
from optiserve.optimize.architecture import RECIPES
from optiserve.optimize.quantize_ort import CALIB_METHODS
from optiserve.runtime.openvino_backend import _unavailable as openvino_unavailable
from optiserve.runtime.torch_backends import tensorrt_unavailable, torch_device
from optiserve.tasks import GateLimits, gate_minimums, list_tasks, unmatched_answers
from optiserve.tasks.output_kinds import list_output_kinds


SEARCH_MODES = ("off", "on", "auto")


@dataclass
class OptimizeConfig:
    model: str
    weights: str | None = None        # None: the trained digits checkpoint (trained on demand) or the model default
    dataset: str = "digits"
    int8: bool = False
    prune: float | None = None            # unstructured sparsity in (0, 1)
    prune_channels: float | None = None   # fraction of channels removed in (0, 1)
    finetune_epochs: int = 5
    search: str = "off"               # prune at several ratios, recover, keep the frontier: on | off | auto (where it applies;
                                      # the CLI's default)
    search_minutes: float = 10.0      # the search's budget for recovery
    search_ratios: tuple[float, ...] = (0.3, 0.5, 0.7)  # fractions of channels the search removes, light to heavy
    resume: bool = False              # take the candidates an interrupted search already recovered
    tensorrt: bool = False
    fp16: bool = False
    onnx: bool = True
    openvino: bool = True             # OpenVINO IR variants (built from the ONNX files)
    ort_transformer: bool = True      # a text model: onnx-fused, and with int8 onnx-fused-int8 and onnx-int8-static
    packed: bool = False              # a text encoder: onnx-fp32-packed and openvino-fp32-packed, with int8
                                      # onnx-int8-packed and openvino-int8-packed (and each search candidate's
                                      # <name>-int8-packed and openvino-<name>-int8-packed)
    calib_size: int = 256
    calib_method: str = "minmax"
    int8_recipe: str = "auto"         # auto: transformer where the graph has attention, else convolutional
    max_accuracy_drop: float = 1.0    # percentage points of top-1
    accuracy_aware: bool = True       # an ONNX INT8 variant that misses the gate keeps its most sensitive layers in float
    max_float_layers: int = 8
    latency_batch: int = 16
    timing_rounds: int = 15           # interleaved rounds per batch size; a tie is timed again for twice as many
    seq_lengths: tuple[int, ...] | None = None  # a text model's timed lengths in tokens (None: 16, 64, 256 up to its max)
    timing_texts: str | None = None   # a text model: a file of texts (a sample of the service's) the batch columns time,
                                      # in place of the validation texts
    out: str | None = None
    device: str = "auto"
    progress: bool = True
    num_classes: int | None = None    # for builders that take it (torchvision, timm, a callable with num_classes)
    input: InputOverrides = field(default_factory=InputOverrides)  # --input-shape, --mean, --std
    labels: str | None = None         # a file with one class name a line
    task: str | None = None           # None: classification for one [N, K] output
    task_output: str | None = None    # a model with several outputs: the one the task reads (None: the first)
    detection_head: str = "auto"      # detection from an ONNX file: rows | yolov5 | yolov8 | detr (auto: by shapes)
    agnostic_nms: bool = False        # ... NMS over all classes at once instead of per class
    box_units: str = "auto"           # ... a YOLO head's boxes: auto (pixels, checked) | pixels | normalized
    output_kind: str = "auto"         # logits | probabilities | log_probabilities | multi_label (auto: read from the model)
    min_cosine: float = GateLimits.min_cosine  # each task's gate minimum (tasks declare them: GateMinimum)
    min_miou: float = GateLimits.min_miou
    min_map: float = GateLimits.min_map
    masks: str | None = None          # segmentation: a folder of the images' true masks (class-id PNGs)
    ignore_index: int = 255           # a mask's value for pixels not to score
    boxes: str | None = None          # detection: a COCO-format file of the images' true boxes
    test: str | None = None           # a separate image folder (class subfolders) whose images only report
    tokenizer: str | None = None      # an ONNX file of a text model: the folder holding its tokenizer.json

    @property
    def gate_limits(self) -> GateLimits:
        return GateLimits(max_accuracy_drop=self.max_accuracy_drop,
                          **{minimum.name: getattr(self, minimum.name) for _, minimum in gate_minimums()})

    def validate(self) -> None:
        find_source(self.model)
        if self.task is not None and self.task not in list_tasks():
            raise UserError(f"unknown --task {self.task!r}; use {' | '.join(list_tasks())}")
        if self.output_kind != "auto" and self.output_kind not in list_output_kinds():
            raise UserError(f"unknown --output-kind {self.output_kind!r}; use auto, {', '.join(list_output_kinds())}")
        for _, minimum in gate_minimums():
            if not minimum.low <= getattr(self, minimum.name) <= minimum.high:
                raise UserError(f"{minimum.flag} must be in [{minimum.low:g}, {minimum.high:g}], got "
                                f"{getattr(self, minimum.name)}")
        if self.num_classes is not None and self.num_classes < 1:
            raise UserError(f"--num-classes must be at least 1, got {self.num_classes}")
        if self.calib_method not in CALIB_METHODS:
            raise UserError(f"unknown --calib-method {self.calib_method!r}; use {', '.join(CALIB_METHODS)}")
        if self.int8_recipe != "auto" and self.int8_recipe not in RECIPES:
            raise UserError(f"unknown --int8-recipe {self.int8_recipe!r}; use auto, {', '.join(RECIPES)}")
        if self.calib_size < 1:
            raise UserError(f"--calib-size must be at least 1, got {self.calib_size}")
        if self.max_accuracy_drop < 0:
            raise UserError(f"--max-accuracy-drop must be >= 0 points, got {self.max_accuracy_drop}")
        for flag, value in (("--prune", self.prune), ("--prune-channels", self.prune_channels)):
            if value is not None and not 0.0 < value < 1.0:
                raise UserError(f"{flag} must be a fraction in (0, 1), e.g. 0.5; got {value}")
        if is_onnx_file(self.model):
            for flag, given in (("--prune", self.prune is not None), ("--prune-channels", self.prune_channels is not None),
                                ("--search", self.search == "on"), ("--tensorrt", self.tensorrt),
                                ("--no-onnx", not self.onnx)):
                if given:
                    raise UserError(f"{flag} works on a torch model; {self.model} is an ONNX file (its variants are "
                                    f"onnx-fp32, onnx-int8 and the OpenVINO ones)")
        unmatched = unmatched_answers(self.task) if self.task is not None else None
        if self.prune_channels is not None and unmatched:
            raise UserError(f"--prune-channels recovers the pruned model by matching the original's answers one to "
                            f"one, which {unmatched} cannot be; use --prune (unstructured) instead")
        if (self.prune is not None or self.prune_channels is not None) and not self.onnx:
            raise UserError("pruned variants are built as ONNX Runtime models; drop --no-onnx")
        if self.packed and self.openvino and (why := openvino_unavailable()):
            raise UserError(f"--packed builds OpenVINO variants too, which cannot be built here: {why}; "
                            f"or add --no-openvino for the ONNX Runtime ones only")
        if self.packed and self.openvino and self.int8 and importlib.util.find_spec("nncf") is None:
            raise UserError("openvino-int8-packed is quantized by NNCF, and the nncf package is not installed: "
                            "pip install nncf, or add --no-openvino for the ONNX Runtime packed variants only")
        if self.openvino and self.onnx and (why := openvino_unavailable()):
            raise UserError(f"the OpenVINO variants cannot be built here: {why}; or add --no-openvino")
        if self.openvino and self.onnx and self.int8 and importlib.util.find_spec("nncf") is None:
            raise UserError("openvino-int8 compares NNCF's quantization with the QDQ file, and the nncf package is "
                            "not installed: pip install nncf, or add --no-openvino")
        if self.fp16 and not self.tensorrt:
            raise UserError("--fp16 builds a TensorRT FP16 engine; add --tensorrt")
        torch_device(self.device)  # --device cuda without a GPU fails here, not after the build
        if self.tensorrt and (why := tensorrt_unavailable()):
            raise UserError(f"--tensorrt cannot run here: {why}")
        if self.search not in SEARCH_MODES:
            raise UserError(f"search must be one of {', '.join(SEARCH_MODES)}, got {self.search!r}")
        if self.search == "on" and self.prune_channels is not None:
            raise UserError("--prune-channels prunes at the one ratio given; the search tries several: give one of "
                            "them, or --no-search")
        if self.search == "on" and not self.onnx:
            raise UserError("the search builds ONNX Runtime and OpenVINO candidates; drop --no-onnx or add --no-search")
        if not self.search_ratios or any(not 0.0 < r < 1.0 for r in self.search_ratios) \
                or list(self.search_ratios) != sorted(set(self.search_ratios)):
            raise UserError(f"--search-ratios must be fractions in (0, 1), light to heavy, e.g. 0.3,0.5,0.7; got "
                            f"{','.join(f'{r:g}' for r in self.search_ratios)}")
        if self.search_minutes <= 0:
            raise UserError(f"--search-minutes must be more than 0, got {self.search_minutes:g}")
        if self.finetune_epochs < 0:
            raise UserError(f"--finetune-epochs must be >= 0, got {self.finetune_epochs}")
        if self.max_float_layers < 1:
            raise UserError(f"--max-float-layers must be at least 1, got {self.max_float_layers}")
        if self.latency_batch < 1:
            raise UserError(f"--latency-batch must be at least 1, got {self.latency_batch}")
        if self.seq_lengths is not None and (not self.seq_lengths or min(self.seq_lengths) < 1):
            raise UserError(f"--seq-lengths must be positive numbers of tokens, e.g. 16,64,256; got "
                            f"{','.join(map(str, self.seq_lengths))}")
        if self.timing_texts is not None and not self.timing_file.is_file():
            said = "is a folder" if self.timing_file.is_dir() else "does not exist"
            raise UserError(f"--timing-texts {self.timing_texts}: {said}; give a file of texts (.txt one a line, "
                            f".tsv or .csv)")
        if self.timing_texts is not None and (held := self._holds_test_texts(self.timing_file)):
            raise UserError(f"--timing-texts {self.timing_texts} {held}, whose texts only report: timing chooses the "
                            f"recommendation, so give texts the test split does not hold (the service's own, or a "
                            f"validation file)")
        if self.timing_rounds < 3:
            raise UserError(f"--timing-rounds must be at least 3 (a median and its interval need a few), "
                            f"got {self.timing_rounds}")

    def _holds_test_texts(self, path: Path) -> str | None:
        """How `path` holds the dataset's test texts (data/text.py's `test_files`), or None."""
        if not self.dataset.startswith("text:"):
            return None
        from optiserve.data.text import test_files

        return test_files(self.dataset[len("text:"):]).get(path.resolve())

    @property
    def timing_file(self) -> Path:
        """--timing-texts as a path: `text:` may lead it, as `--dataset text:FILE` and `bench --texts` take it."""
        given = self.timing_texts or ""
        return Path(given[len("text:"):] if given.startswith("text:") else given).expanduser()

    @property
    def out_path(self) -> Path:
        if self.out:
            return Path(self.out)
        data = Path(self.dataset.split(":", 1)[1]).name if ":" in self.dataset else self.dataset
        return Path("artifacts") / f"{model_slug(self.model)}-{data}"
