"""`optiserve optimize` (also installed as plain `optimize`): arguments, run, summary table."""

from __future__ import annotations

import argparse

from optiserve.data import DATASET_CHOICES
from optiserve.models import RESIZE_MODES, InputOverrides, list_models
from optiserve.tasks import gate_minimums, list_tasks
from optiserve.tasks.output_kinds import get_output_kind, list_output_kinds
from optiserve.models.detector_heads import get_head, list_heads
from optiserve.models.detector_heads.registry import BOX_UNITS
from optiserve.models.weights import WEIGHT_CHOICES
from optiserve.optimize.config import OptimizeConfig
from optiserve.optimize.pipeline import run_optimize
from optiserve.optimize.report import recommendation_line, summary_header, summary_rows
from optiserve.optimize.architecture import RECIPES
from optiserve.optimize.quantize_ort import CALIB_METHODS

DESCRIPTION = """\
Build faster variants of MODEL, check each against the fp32 model on held-out data, and write
an artifact folder (one file per variant, manifest.json, report.md) that the server loads.

  optimize resnet18 --int8          small-input ResNet-18 on the bundled digits; trains it first
                                    when checkpoints/resnet18-digits.pt does not exist yet
  optimize resnet50 --weights imagenet --dataset imagefolder:PATH --int8
  optimize timm:resnet18 --num-classes 10 --weights my.safetensors --dataset imagefolder:PATH --int8
  optimize nets/tiny.py:build --input-shape 3,64,64 --weights tiny.pt --dataset imagefolder:PATH --int8

MODEL forms (docs/own-model.md): a registered name; torchvision:NAME; timm:NAME; model.onnx; a
TorchScript file; path/to/file.py:build or package.module:build, your function returning an nn.Module (its code runs)."""

DEFAULTS = OptimizeConfig(model="resnet18")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = DESCRIPTION
    p.add_argument("model", metavar="MODEL",
                   help=f"a registered model ({', '.join(list_models())}), torchvision:NAME, timm:NAME, "
                        f"model.onnx, a TorchScript file, a torch.export model.pt2, path/to/file.py:build or "
                        f"package.module:build")
    p.add_argument("--weights", default=None, metavar="W",
                   help=f"{WEIGHT_CHOICES} (default: checkpoints/MODEL-digits.pt for digits, trained if "
                        f"missing; otherwise the model's default)")
    p.add_argument("--num-classes", type=int, default=None, metavar="N",
                   help="classes of the model's head, for builders that take num_classes (default: the builder's, "
                        "or the number of --labels)")
    p.add_argument("--input-shape", type=_ints(3), default=None, metavar="C,H,W",
                   help="the input one image is given as (default: what the model's source says)")
    p.add_argument("--mean", type=_floats, default=None, metavar="M[,M,M]",
                   help="per-channel mean the pixels (scaled to [0, 1]) are normalized with (default: the source's, "
                        "else ImageNet's for 3 channels)")
    p.add_argument("--std", type=_floats, default=None, metavar="S[,S,S]", help="per-channel std, as --mean")
    p.add_argument("--resize", default=None, type=_resize, metavar="{crop,stretch,letterbox,SIDE}",
                   help="how an image of another size becomes the input: crop (the shorter side resized as the "
                        "model's source says, else 256 for 224, then the center crop), SIDE (crop, the shorter "
                        "side resized to SIDE pixels), stretch (the whole image; segmentation's and detection's "
                        "default) or letterbox (the whole image, its aspect kept, padded with the mean colour, or "
                        "gray 114 for a YOLO head; detection)")
    p.add_argument("--labels", default=None, metavar="FILE", help="class names, one a line, in output order")
    p.add_argument("--task", default=None, choices=list_tasks(),
                   help="what the model's output means (default: classification for one [N, K] output; a text "
                        "model's, as its folder or --tokenizer DIR says)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="MODEL is an ONNX file of a text encoder or classifier: the folder holding its "
                        "tokenizer.json (and sentence-transformers' pooling modules, config.json's id2label, "
                        "the max length) (docs/text.md)")
    p.add_argument("--task-output", default=None, metavar="NAME",
                   help="a model with several outputs: the one the task reads (default: the first); every "
                        "output is served under its own name")
    p.add_argument("--detection-head", default="auto", choices=["auto", *list_heads()],
                   help="detection, an ONNX file: how its outputs are laid out — " + "; ".join(
                       f"{h}: {get_head(h).layout}" for h in list_heads()) +
                   " (default auto: read from the output shapes). Decoding and NMS are appended to the graph, "
                        "as the exporter's own post-processing does it: each box under its best class, NMS per class")
    p.add_argument("--agnostic-nms", action="store_true",
                   help="detection, a YOLO head: NMS over all classes at once (Ultralytics' agnostic_nms)")
    p.add_argument("--box-units", default="auto", choices=list(BOX_UNITS),
                   help="detection, a YOLO head: its boxes in input pixels or normalised to 0..1 (default auto: "
                        "pixels, and a run whose boxes all lie within 0..1 on the validation images stops to ask)")
    p.add_argument("--output-kind", default="auto", choices=["auto", *list_output_kinds()],
                   help="classification, segmentation: what the scores hold — " + "; ".join(
                       f"{k}: {get_output_kind(k).description}" for k in list_output_kinds()) +
                   " (default auto: read from the operation the model ends in, confirmed on fp32's outputs for the "
                   "held-out images)")
    for task, minimum in gate_minimums():
        p.add_argument(minimum.flag, type=float, default=getattr(DEFAULTS, minimum.name), metavar="M",
                       help=f"{task}: reject variants whose {minimum.measure} is below M "
                            f"(default {minimum.default:g})")
    p.add_argument("--masks", default=None, metavar="DIR",
                   help="segmentation: the true masks of --dataset imagefolder:PATH's images (DIR/IMAGE.png, "
                        "class ids); variants are then judged by mIoU against them")
    p.add_argument("--test", default=None, metavar="DIR",
                   help="a separate folder of test images in class subfolders (the dataset's classes): the "
                        "table's accuracy is read on them, once, after every choice; the dataset's validation "
                        "split still chooses")
    p.add_argument("--boxes", default=None, metavar="FILE",
                   help="detection: the true boxes of --dataset imagefolder:PATH's images, a COCO-format JSON file "
                        "(category ids are the model's class ids); variants are then judged by mAP@0.5 against them")
    p.add_argument("--ignore-index", type=int, default=DEFAULTS.ignore_index, metavar="N",
                   help=f"the mask value of pixels not to score (default {DEFAULTS.ignore_index})")
    p.add_argument("--dataset", default=DEFAULTS.dataset, metavar="NAME",
                   help=f"calibration and evaluation data: {DATASET_CHOICES} (default {DEFAULTS.dataset})")
    p.add_argument("--int8", action="store_true", help="add INT8 variants (ONNX Runtime: static QDQ for an image model, dynamic and static for a text model; OpenVINO: NNCF)")
    p.add_argument("--prune", type=float, default=None, metavar="SPARSITY",
                   help="add an unstructured-pruned variant (global L1) with this fraction of weights zeroed")
    p.add_argument("--search", action=argparse.BooleanOptionalAction, default=None,
                   help="search for the fastest model that passes: prune channels (a text model: drop layers, "
                        "and prune heads and feed-forward channels) at several ratios (light to heavy, stopping at the first that fails the gate), recover each "
                        "by distillation, build their INT8 variants, keep the speed/accuracy frontier (default: on "
                        "where the data can judge a torch model's or a text model folder's accuracy and "
                        "--prune-channels is not given)")
    p.add_argument("--search-minutes", type=float, default=DEFAULTS.search_minutes, metavar="M",
                   help=f"the search's time for recovery and its judging, shared among its candidates; their "
                        f"exports and INT8 and packed copies are not counted (default {DEFAULTS.search_minutes:g})")
    p.add_argument("--resume", action="store_true",
                   help="take the candidates an interrupted search already pruned and recovered (kept beside the "
                        "artifact folder until it is published) instead of recovering them again")
    p.add_argument("--search-ratios", type=_floats, default=DEFAULTS.search_ratios, metavar="R,R,...",
                   help="the fractions of channels (a text model: of layers, and of heads and feed-forward "
                        "channels) the search removes, light to heavy "
                        "(default "
                        f"{','.join(f'{r:g}' for r in DEFAULTS.search_ratios)})")
    p.add_argument("--prune-channels", type=float, default=None, metavar="RATIO",
                   help="add structured-pruned variants with this one fraction of channels removed, recovered by "
                        "distillation (and INT8 with --int8)")
    p.add_argument("--finetune-epochs", type=int, default=DEFAULTS.finetune_epochs, metavar="N",
                   help=f"epochs of recovery after structured pruning, by distillation from the unpruned model; "
                        f"rounds twice as long follow while the validation images say it is not there yet "
                        f"(default {DEFAULTS.finetune_epochs})")
    p.add_argument("--tensorrt", action="store_true",
                   help="add TensorRT engines through torch-tensorrt (needs a CUDA GPU and the [tensorrt] extra)")
    p.add_argument("--fp16", action="store_true", help="with --tensorrt, also build an FP16 engine")
    p.add_argument("--onnx", action=argparse.BooleanOptionalAction, default=True,
                   help="build the ONNX Runtime variants (default on; --no-onnx skips them and INT8 with them)")
    p.add_argument("--openvino", action=argparse.BooleanOptionalAction, default=True,
                   help="build the OpenVINO variants from the ONNX files: openvino-fp32, openvino-bf16 where the "
                        "CPU has bf16, openvino-int8 with --int8 (default on; --no-openvino skips them)")
    p.add_argument("--ort-transformer", action=argparse.BooleanOptionalAction, default=True,
                   help="a text model: ONNX Runtime's transformer variants, onnx-fused (its attention, LayerNorm and "
                        "GELU fusions) and with --int8 onnx-fused-int8 and onnx-int8-static (static QDQ, calibrated "
                        "on training texts) (default on; --no-ort-transformer skips them)")
    p.add_argument("--packed", action=argparse.BooleanOptionalAction, default=False,
                   help="a text encoder: variants that take a batch's texts laid end to end in rows, each text "
                        "attending to itself, with no padding between them: onnx-fp32-packed and openvino-fp32-packed, "
                        "with --int8 onnx-int8-packed and openvino-int8-packed, and with --search "
                        "<candidate>-int8-packed and openvino-<candidate>-int8-packed (default off)")
    p.add_argument("--accuracy-aware", action=argparse.BooleanOptionalAction, default=True,
                   help="an ONNX INT8 variant that misses the accuracy gate is quantized again with its most "
                        "sensitive layers (measured on validation images) kept in float (default on)")
    p.add_argument("--max-float-layers", type=int, default=DEFAULTS.max_float_layers, metavar="N",
                   help=f"most layers accuracy-aware INT8 keeps in float before giving up (default "
                        f"{DEFAULTS.max_float_layers})")
    p.add_argument("--calib-size", type=int, default=DEFAULTS.calib_size, metavar="N",
                   help=f"training images used to calibrate INT8 ranges (default {DEFAULTS.calib_size})")
    p.add_argument("--calib-method", choices=CALIB_METHODS, default=DEFAULTS.calib_method,
                   help=f"how activation ranges are chosen (default {DEFAULTS.calib_method})")
    p.add_argument("--int8-recipe", choices=("auto", *RECIPES), default=DEFAULTS.int8_recipe,
                   help="what INT8 quantizes: transformer = MatMul/Gemm and the patch Conv, LayerNorm, Softmax, "
                        "GELU in float; convolutional = each quantizer's defaults; auto (default) picks "
                        "transformer where the graph has attention")
    p.add_argument("--max-accuracy-drop", type=float, default=DEFAULTS.max_accuracy_drop, metavar="PCT",
                   help="reject variants whose top-1 (mIoU x 100 against --masks, mAP@0.5 x 100 against --boxes) "
                        f"falls more than this many points below fp32's (default {DEFAULTS.max_accuracy_drop:g})")
    p.add_argument("--latency-batch", type=int, default=DEFAULTS.latency_batch, metavar="N",
                   help=f"the larger batch size latency is measured at, beside batch 1 (default "
                        f"{DEFAULTS.latency_batch})")
    p.add_argument("--timing-rounds", type=int, default=DEFAULTS.timing_rounds, metavar="N",
                   help=f"interleaved rounds every variant is timed in at each batch size (default "
                        f"{DEFAULTS.timing_rounds}; two the rounds cannot separate are timed again for twice as "
                        f"many): fewer finish sooner, with wider intervals and more ties")
    p.add_argument("--seq-lengths", type=_lengths, default=None, metavar="N,N,...",
                   help="a text model: the sequence lengths (tokens per row, real validation text, no padding) "
                        "every variant is also timed at, at --latency-batch, each reported with its speedup and "
                        "whether the recommendation holds there (default 16,64,256, those above the model's max "
                        "length skipped)")
    p.add_argument("--timing-texts", default=None, metavar="FILE",
                   help="a text model: time every variant at batch 1 and --latency-batch on texts drawn from FILE "
                        "(a sample of what the service will be sent; any text dataset file, its labels unread) "
                        "instead of the validation texts, so that the recommendation follows the service's text "
                        "lengths; never used to judge or fit (default: the validation texts)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where variants are validated and timed (default auto)")
    p.add_argument("--out", default=None, metavar="DIR", help="artifact folder (default artifacts/MODEL-DATASET)")
    p.add_argument("--no-progress", action="store_true", help="print only the final table")


def run(args: argparse.Namespace) -> int:
    cfg = OptimizeConfig(
        model=args.model, weights=args.weights, dataset=args.dataset, int8=args.int8, onnx=args.onnx, openvino=args.openvino,
        ort_transformer=args.ort_transformer, packed=args.packed,
        accuracy_aware=args.accuracy_aware, max_float_layers=args.max_float_layers,
        prune=args.prune, prune_channels=args.prune_channels, finetune_epochs=args.finetune_epochs,
        search="auto" if args.search is None else ("on" if args.search else "off"), search_minutes=args.search_minutes,
        search_ratios=args.search_ratios, resume=args.resume,
        tensorrt=args.tensorrt, fp16=args.fp16,
        calib_size=args.calib_size, calib_method=args.calib_method, int8_recipe=args.int8_recipe,
        max_accuracy_drop=args.max_accuracy_drop,
        latency_batch=args.latency_batch, timing_rounds=args.timing_rounds, seq_lengths=args.seq_lengths,
        timing_texts=args.timing_texts, out=args.out, device=args.device, progress=not args.no_progress,
        num_classes=args.num_classes, labels=args.labels, task=args.task, task_output=args.task_output, output_kind=args.output_kind,
        detection_head=args.detection_head, agnostic_nms=args.agnostic_nms, box_units=args.box_units,
        **{minimum.name: getattr(args, minimum.name) for _, minimum in gate_minimums()}, masks=args.masks, ignore_index=args.ignore_index, boxes=args.boxes,
        test=args.test, tokenizer=args.tokenizer,
        input=InputOverrides(args.input_shape, args.mean, args.std, args.resize),
    )
    manifest = run_optimize(cfg)
    print(format_table(summary_header(manifest), summary_rows(manifest)))
    if not manifest["accuracy_meaningful"]:
        print(f"accuracy not validated: {manifest['accuracy_note']}; variants are 'unvalidated' and served "
              f"only when named explicitly")
    for v in manifest["variants"]:
        if v["status"] == "rejected":
            print(f"{v['name']} rejected: {v['reason']}; not served by default")
    print(recommendation_line(manifest).replace("**", ""))
    print(f"wrote {cfg.out_path}/ (manifest.json, report.md, {len(manifest['variants'])} variants)")
    return 0


def _resize(text: str) -> str | int:
    if text in RESIZE_MODES:
        return text
    try:
        side = int(text)
    except ValueError:
        side = 0
    if side < 1:
        raise argparse.ArgumentTypeError(f"expected {', '.join(RESIZE_MODES)} or a side in pixels, got {text!r}")
    return side


def _ints(n: int):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if len(values) != n or min(values) < 1:
            raise argparse.ArgumentTypeError(f"expected {n} positive integers separated by commas, e.g. 3,224,224; "
                                             f"got {text!r}")
        return values
    return parse


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers of tokens separated by commas, e.g. 16,64,256; "
                                         f"got {text!r}")
    return values


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, e.g. 0.5,0.5,0.5; got {text!r}"
                                         ) from None


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
