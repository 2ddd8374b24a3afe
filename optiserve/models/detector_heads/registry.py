"""The detector-head registry: what a head's outputs look like, how its decoding is appended, and
the input preprocessing its own tools use."""

from __future__ import annotations

from dataclasses import dataclass

from optiserve.errors import UserError
from optiserve.models.onnx_file import ModelOutput, show_shape
from optiserve.registry import Registry

DETECTIONS = 100        # rows per image after decoding: the D of [N, D, 6]
SCORE_FLOOR = 0.01      # candidates scoring at most this are dropped before NMS
BOX_UNITS = ("auto", "pixels", "normalized")


@dataclass(frozen=True)
class HeadDecoding:
    """How the user says a head's raw boxes are decoded: NMS over all classes at once
    (`agnostic_nms`, as Ultralytics' `agnostic_nms=True`) rather than per class, and the units of
    a YOLO head's boxes (auto: input pixels, confirmed on the validation images)."""

    agnostic_nms: bool = False
    box_units: str = "auto"

    def __post_init__(self):
        if self.box_units not in BOX_UNITS:
            raise UserError(f"--box-units {self.box_units}: use {' | '.join(BOX_UNITS)}")


@dataclass(frozen=True)
class Preprocessing:
    """The input a head's own tools feed it (used where --mean/--std/--resize are not given)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    resize: str
    pad: int | None = None  # letterbox's fill (0-255) where it is not the mean colour


class DetectorHead:
    """One head layout. Subclasses set `name`, `layout` (as errors and docs show it), `preprocessing`
    (None: the source's), and implement `fits` and `append`."""

    name: str = ""
    layout: str = ""
    preprocessing: Preprocessing | None = None
    native: bool = False  # the graph already gives [N, D, 6] rows: nothing is appended

    def fits(self, outputs: tuple[ModelOutput, ...]) -> bool:
        """Whether the graph's outputs (batch axis first, sizes known) have this head's layout."""
        raise NotImplementedError

    def claims(self, outputs: tuple[ModelOutput, ...]) -> bool:
        """Whether the layout is unambiguously this head's, so it is chosen without --detection-head."""
        return self.fits(outputs)

    def append(self, edit, outputs: tuple[ModelOutput, ...], image_size: tuple[int, int],
               decoding: HeadDecoding) -> tuple[str, dict]:
        """Append the decoding to `edit`'s graph as `decoding` says; returns the name of the
        [N, D, 6] tensor and the settings the manifest records."""
        raise NotImplementedError


_HEADS: Registry[DetectorHead] = Registry("detector head")


def register_head(head: DetectorHead) -> DetectorHead:
    return _HEADS.register(head.name, head)


def get_head(name: str) -> DetectorHead:
    return _HEADS.get(name)


def list_heads() -> list[str]:
    return _HEADS.names()


def head_for(outputs: tuple[ModelOutput, ...], asked: str, model: str) -> DetectorHead:
    """The head `asked` for (checked against the outputs), or with "auto" the one whose layout the
    outputs have; one line naming the layouts where none or several claim them."""
    heads = [get_head(name) for name in list_heads()]
    shapes = ", ".join(f"{o.name} {show_shape(o.shape)}" for o in outputs)
    if asked != "auto":
        head = get_head(asked)
        if not head.fits(outputs):
            raise UserError(f"--detection-head {asked} reads {head.layout}; {model} gives {shapes}")
        return head
    claiming = [h for h in heads if h.claims(outputs)]
    if len(claiming) == 1:
        return claiming[0]
    layouts = "; ".join(f"{h.name}: {h.layout}" for h in heads)
    if claiming:
        raise UserError(f"{model} gives {shapes}, which reads as {' or '.join(h.name for h in claiming)}: say which "
                        f"with --detection-head")
    raise UserError(f"--task detection: {model} gives {shapes}, which is no detector head optiserve reads ({layouts})")


def fixed(shape) -> bool:
    return all(isinstance(d, int) for d in shape[1:])
