"""The detector heads `--task detection` takes from an ONNX file, each brought to the one form the
task reads — [N, D, 6] rows of x1, y1, x2, y2 (input pixels), score, class id, the best first —
by decoding, a score floor and non-maximum suppression appended to the graph, so that every
engine runs any batch and INT8 leaves the post-processing in float (see optimize.architecture).

Adding a head is a module with a `DetectorHead` and its `register_head` call, imported below.
"""

from optiserve.models.detector_heads.registry import (DetectorHead, HeadDecoding, get_head,  # noqa: F401
                                                      head_for, list_heads, register_head)
from optiserve.models.detector_heads import rows, yolo, detr  # noqa: F401,E402  registration
