"""`optimize`: model -> fused -> TorchScript / ONNX / INT8 variants -> validated artifact folder.
The model and the data are loaded and checked here; the passes (optimize/passes/) build the
variants, optimize/judge.py judges and times them through the runtime, optimize/manifest.py
writes what was found."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from optiserve import artifacts
from optiserve.data import DatasetSplits, load_dataset
from optiserve.errors import UserError
from optiserve.models import LoadedModel, load_model, read_labels
from optiserve.models.detector_heads import HeadDecoding
from optiserve.models.onnx_file import is_onnx_file
from optiserve.models.output_ending import MULTI_LABEL
from optiserve.models.text_folder import is_text_folder
from optiserve.models.sources import is_registered
from optiserve.optimize.attempts import LOG_FILE, Attempts
from optiserve.optimize.config import OptimizeConfig  # noqa: F401  importers take it from here too
from optiserve.optimize.frontier import drop_off_frontier, mark_frontier
from optiserve.optimize.frontier_plot import FILE as FRONTIER_PLOT, render_frontier
from optiserve.optimize.lengths import lengths_to_time
from optiserve.optimize.judge import recommend, report_on_test, stated_against_graph, validate
from optiserve.optimize.manifest import BASELINE, build_manifest, device_note, int8_comparison
from optiserve.optimize.passes import Run, Variant, passes_for, step_count
from optiserve.optimize.passes.pruning import pruning_ratios
from optiserve.optimize.progress import PassLog
from optiserve.optimize.search_cache import clear_cache
from optiserve.optimize.trace import validation_batches
from optiserve.optimize.report import render_report
from optiserve.optimize.validate import EvalSet, materialize
from optiserve.tasks import get_task, unmatched_answers
from optiserve.text_input import TextInput, text_lengths, trim_padding


def default_checkpoint(model: str, dataset: str) -> Path:
    return Path("checkpoints") / f"{model}-{dataset}.pt"


def resolve_weights(cfg: OptimizeConfig, log: PassLog) -> LoadedModel:
    """Load the weights; for the bundled digits data, train a checkpoint first when there is none yet."""
    weights = cfg.weights
    labels = read_labels(cfg.labels) if cfg.labels else None
    if is_registered(cfg.model) and weights is None and cfg.dataset == "digits":
        ckpt = default_checkpoint(cfg.model, "digits")
        if not ckpt.is_file():
            from optiserve.train import TrainConfig, train

            log.note(f"no trained checkpoint at {ckpt}: training {cfg.model} on digits first "
                     f"(optiserve train {cfg.model} --dataset digits)")
            train(TrainConfig(model=cfg.model, dataset="digits", out=str(ckpt), progress=cfg.progress))
        weights = str(ckpt)
    return load_model(cfg.model, weights, cfg.num_classes, overrides=cfg.input, labels=labels, task=cfg.task,
                      task_output=cfg.task_output, detection_head=cfg.detection_head,
                      decoding=HeadDecoding(cfg.agnostic_nms, cfg.box_units), tokenizer=cfg.tokenizer)


def class_mapping(model_classes: list[str], data_classes: list[str]) -> list[int] | None:
    """Model class index for each dataset class, matched by name (so an image folder whose class
    folders are named after ImageNet categories, e.g. `tench/`, scores an ImageNet model); None when
    some dataset class is not among the model's."""
    norm = lambda name: name.lower().replace("_", " ").strip()  # noqa: E731
    index = {norm(c): i for i, c in enumerate(model_classes)}
    mapping = [index.get(norm(c)) for c in data_classes]
    return None if None in mapping else mapping


def _check_compatible(loaded: LoadedModel, data: DatasetSplits, read: str | None) -> tuple[str, list[int] | None]:
    """('', class mapping) when variants can be judged on `data` for `loaded` (its scores holding
    `read`, as far as known), else (why not, None); the mapping is None where the data's labels cannot
    score the model (none, or not its classes), and a classifier is then judged by top-1 agreement
    with fp32. Raises on pairs, or sets of classes, that cannot run."""
    if isinstance(loaded.input, TextInput):  # its texts were tokenized for it (data/text_tokens.py)
        if not get_task(loaded.task).scored_by_labels:
            return "", None
        if data.truth == "pairs":
            raise UserError(f"dataset {data.name} holds scored pairs (text1, text2, score), which judge a sentence "
                            f"encoder; {loaded.name} is a {loaded.task} model: give texts, labelled or not")
        if data.truth == "class-sets":
            return "", _class_sets_mapping(loaded, data, read)
        return "", class_mapping(loaded.classes, data.classes) if data.labelled else None
    if tuple(loaded.input.shape) != tuple(data.input.shape):
        fix = ("use the dataset the checkpoint was trained on" if loaded.rebuildable else
               "give your images with --dataset imagefolder:PATH (or --dataset synthetic for a smoke run)")
        raise UserError(f"the model takes input {list(loaded.input.shape)} but dataset {data.name} gives "
                        f"{list(data.input.shape)}; {fix}")
    if not loaded.accuracy_meaningful:
        return "random weights: accuracy is meaningless", None
    if not data.real_images:
        return f"dataset {data.name} is random tensors, not images: accuracy cannot be measured", None
    if not get_task(loaded.task).scored_by_labels or not data.labelled:
        return "", None  # judged against fp32's outputs: no labels needed
    return "", class_mapping(loaded.classes, data.classes)


def _class_sets_mapping(loaded: LoadedModel, data: DatasetSplits, read: str | None) -> list[int]:
    """The model's class of each of the data's, for texts labelled with sets of classes (`a|b`): only a
    multi-label classifier's scores read them, and every name must be one of its classes (one line
    otherwise: a set half matched would score the model on classes it was never asked about)."""
    if read != MULTI_LABEL:
        raise UserError(f"dataset {data.name} labels texts with sets of classes (a|b), which score a multi-label "
                        f"classifier; {loaded.name} reads one softmax over its classes: give each text one label")
    mapping = class_mapping(loaded.classes, data.classes)
    if mapping is None:
        unknown = next(c for c in data.classes if class_mapping(loaded.classes, [c]) is None)
        raise UserError(f"dataset {data.name} has label {unknown!r}, which is not one of {loaded.name}'s classes "
                        f"({', '.join(loaded.classes[:8])}{', ...' if len(loaded.classes) > 8 else ''}: config.json's "
                        f"id2label, matched by name); label the texts with the model's classes")
    return mapping


def _check_mask_classes(masks: np.ndarray, classes: list[str], cfg: OptimizeConfig) -> None:
    """One line when a mask holds a class id the model does not have (other than --ignore-index)."""
    top = int(masks.max(initial=-1))
    if top >= len(classes):
        raise UserError(f"--masks {cfg.masks}: a mask holds class id {top} but the model has {len(classes)} classes "
                        f"(0..{len(classes) - 1}); pixels not to score take --ignore-index (now {cfg.ignore_index})")


LEFT_OUT = {"masks": "without a mask", "boxes": "that --boxes does not annotate", "classes": "unusable"}


def _check_box_classes(boxes: np.ndarray, classes: list[str], cfg: OptimizeConfig) -> None:
    """One line when a true box's category id is not a class of the model (where it names its classes)."""
    top = max((int(rows[:, 5].max()) for rows in boxes if len(rows)), default=-1)
    if classes and top >= len(classes):
        raise UserError(f"--boxes {cfg.boxes}: a box has category_id {top} but the model has {len(classes)} classes "
                        f"(0..{len(classes) - 1}); a category id is the model's class id (as torchvision's "
                        f"COCO detectors number them)")


def _use_test_folder(data: DatasetSplits, cfg: OptimizeConfig) -> None:
    """--test DIR: its images report in place of the dataset's test split (which then goes unread)."""
    from optiserve.data.imagefolder import load_test_folder

    if data.truth != "classes" or not data.labelled:
        raise UserError("--test takes a folder of labelled class subfolders: it reports a classifier's accuracy; "
                        "for masks or boxes, put the test images in the dataset's own test/ folder")
    data.test = load_test_folder(cfg.test, data.input, data.classes)
    data.split_note = f"the test images are --test {cfg.test}'s {len(data.test)}"


def _held_out(split, data: DatasetSplits, loaded: LoadedModel, cfg: OptimizeConfig, mapping) -> EvalSet:
    """A held-out split's images with their labels in the model's classes (or its checked masks or boxes)."""
    held = materialize(split, data.labelled, data.truth)
    if data.truth == "masks":
        _check_mask_classes(held.labels, loaded.classes, cfg)
    elif data.truth == "boxes":
        _check_box_classes(held.labels, loaded.classes, cfg)
    elif data.truth == "pairs":
        pass  # the pairs' scores, which the text-embedding task reads as they are
    elif data.truth == "class-sets" and mapping is None:  # a model its labels do not score (an encoder)
        held.labels = None
    elif data.truth == "class-sets":  # the data's classes put in the model's columns
        sets = np.zeros((len(held.labels), len(loaded.classes)), dtype=np.int64)
        sets[:, mapping] = held.labels
        held.labels = sets
    else:
        held.labels = None if mapping is None else np.asarray(mapping)[held.labels]
    return held


def _judged_by_agreement(loaded: LoadedModel, data: DatasetSplits, why_not: str, mapping,
                         read: str | None) -> list[str]:
    """The note that says a classifier is judged without labels, and why (its task's words, as its
    scores are read)."""
    if why_not or not get_task(loaded.task).scored_by_labels:
        return []
    # labels score a multi-label model where they are sets of classes, and any other classifier where one class
    scored = mapping is not None and (data.truth == "class-sets") == (read == MULTI_LABEL)
    note = get_task(loaded.task, read).judged_note(data.name, data.labelled, scored)
    return [note] if note else []


ROWS_OF_LENGTH = ("validation texts joined and cut by the model's own tokenizer to exactly the length, special "
                  "tokens included, no padding")


def _length_batches(loaded: LoadedModel, data: DatasetSplits, folder: Path | None,
                    cfg: OptimizeConfig) -> tuple[dict[str, np.ndarray], list[dict]]:
    """A text model's timing rows per sequence length (tokens, as a string: --latency-batch rows of
    real validation text each), and the default lengths skipped above its max length; nothing for
    an image model, which --seq-lengths is refused for."""
    if not isinstance(loaded.input, TextInput):
        if cfg.seq_lengths is not None:
            raise UserError(f"--seq-lengths times a text model at set numbers of tokens; {cfg.model} takes images")
        if cfg.packed:
            raise UserError(f"--packed lays a text model's texts end to end in rows; {cfg.model} takes images")
        return {}, []
    from optiserve.data.text_tokens import rows_of_length

    lengths, skipped = lengths_to_time(cfg.seq_lengths, loaded.input.max_length)
    return {str(n): rows_of_length(data.val_texts, loaded.input, folder, n, cfg.latency_batch)
            for n in lengths}, skipped


def _timing_sample(loaded: LoadedModel, folder: Path | None, cfg: OptimizeConfig) -> tuple[np.ndarray | None, dict]:
    """--timing-texts: the token batch the batch columns are timed on (--latency-batch texts drawn
    from the file), and what was drawn; None where the validation texts are timed."""
    if cfg.timing_texts is None:
        return None, {}
    if not isinstance(loaded.input, TextInput):
        raise UserError(f"--timing-texts times a text model on a sample of its service's texts; {cfg.model} takes "
                        f"images")
    from optiserve.data.timing_texts import timing_sample

    try:
        return timing_sample(cfg.timing_file, loaded.input, folder, cfg.latency_batch)
    except UserError as e:
        raise UserError(f"--timing-texts: {e}") from None


def run_optimize(cfg: OptimizeConfig) -> dict:
    """Build, validate and publish every requested variant; returns the manifest."""
    cfg.validate()
    text = is_text_folder(cfg.model) or cfg.tokenizer is not None  # an image model given --tokenizer: refused on load
    form = "text" if text else "onnx" if is_onnx_file(cfg.model) else "torch"
    log = PassLog(step_count(form, cfg), enabled=cfg.progress)
    weights = "its own weights" if form == "text" else cfg.weights or "default weights"
    with log.step(f"load {cfg.model} ({weights})"):
        loaded = resolve_weights(cfg, log)
        if cfg.output_kind != "auto" and not get_task(loaded.task).reads_output_kind:
            raise UserError(f"--output-kind says what a classifier's or segmenter's scores hold; {cfg.model} is "
                            f"run for {loaded.task}")
        read = None  # what its scores hold, as far as the graph or --output-kind tell before anything runs
        if get_task(loaded.task).reads_output_kind:  # read from the graph now: a contradiction stops the run early
            ending = stated_against_graph(loaded, cfg)
            read = cfg.output_kind if cfg.output_kind != "auto" else ending.kind
        unmatched = unmatched_answers(loaded.task, read)
        if cfg.prune_channels is not None and unmatched:
            raise UserError(f"--prune-channels recovers the pruned model by matching the original's answers one to "
                            f"one, which {unmatched} cannot be; use --prune (unstructured) instead")
        if cfg.prune_channels is not None and loaded.outputs:
            raise UserError(f"--prune-channels recovers the pruned model by matching the original's one output; "
                            f"{cfg.model} returns several ({', '.join(o['name'] for o in loaded.outputs)}): use "
                            f"--prune (unstructured) instead")
    with log.step(f"load dataset {cfg.dataset}"):
        for flag, given, task in (("--masks", cfg.masks, "segmentation"), ("--boxes", cfg.boxes, "detection")):
            if given is not None and loaded.task != task:
                raise UserError(f"{flag} scores a {task} model's answers; {cfg.model} is a {loaded.task} model "
                                f"(--task {task}, if it is one)")
        text_folder = loaded.tokenizer_folder  # the text model's folder, or its --tokenizer DIR; None for images
        data = load_dataset(cfg.dataset, loaded.input, len(loaded.classes), masks=cfg.masks,
                            ignore_index=cfg.ignore_index, boxes=cfg.boxes, text_folder=text_folder)
        if cfg.test is not None:
            _use_test_folder(data, cfg)
        why_not, mapping = _check_compatible(loaded, data, read)
        valset = _held_out(data.val, data, loaded, cfg, mapping)
        testset = _held_out(data.test, data, loaded, cfg, mapping)
        length_batches, skipped_lengths = _length_batches(loaded, data, text_folder, cfg)
        timing_tokens, timing_drawn = _timing_sample(loaded, text_folder, cfg)
    left_out = [f"{data.left_out} images {LEFT_OUT[data.truth]} left out"] if data.left_out else []
    noun = "texts" if form == "text" else "images"
    timed_on = [f"time on {timing_drawn['drawn']} texts drawn from {timing_drawn['file']} (--timing-texts; they "
                f"judge nothing)"] if timing_drawn else []
    log.note("; ".join([f"fit on the train split (calibration, recovery); choose on {len(valset.images)} validation "
                        f"{noun} (every gate and choice); report on {len(testset.images)} test {noun}, after "
                        f"every choice", *timed_on, *([data.split_note] if data.split_note else []), *left_out]))

    torch.manual_seed(0)
    example, checks = torch.from_numpy(valset.images[:4]), validation_batches(valset.images)
    out = cfg.out_path
    with artifacts.staging_folder(out) as stage:
        variants: list[Variant] = []
        notes: list[str] = [f"dataset {data.name}: {n}" for n in left_out] + _judged_by_agreement(loaded, data, why_not,
                                                                                                    mapping, read)
        if data.split_note:
            notes.append(f"dataset {data.name}: {data.split_note}")
        skipped: list[dict] = []  # variants this machine cannot run fast, with the reason: rows of their own
        attempts = Attempts(log, stage, skipped)
        run = Run(stage, loaded, data, valset, cfg, why_not, log, attempts, variants, notes, example, checks,
                  label_mapping=None if mapping is None else np.asarray(mapping), read_as=read)
        passes = passes_for(run.form, cfg)
        for each in passes:  # every pass after the baseline is an attempt: one that raises
            each.build(run)  # is its variants' failed rows, and the run goes on
        baseline = "onnx-fp32" if run.form in ("onnx", "text") else BASELINE

        with log.step(f"validate {len(variants)} variants through the runtime (accuracy, latency)"):
            entries, timed, kind = validate(variants, stage, loaded, valset, cfg, why_not, baseline, attempts,
                                            length_batches, timing_tokens)
            # the tokens of the rows the headline batches ran at (padded to their longest text)
            headline_tokens = {b: int(trim_padding(x).shape[2]) for b, x in timed.batches.items()} \
                if length_batches or timing_drawn else {}
            # each text's tokens in the throughput batch: a server that times the variants again times these lengths
            timed_lengths = [int(t) for t in text_lengths(timed.batches[str(cfg.latency_batch)])] \
                if form == "text" else None
            for each in passes:
                if each.settle is not None:
                    entries, settled = each.settle(entries, cfg.latency_batch, timed)
                    notes += settled
            mark_frontier(entries, cfg.latency_batch, loaded.task, kind.get("output_kind"))
            # drawn before the search's candidates off the frontier leave: one the latency choice (at batch 1)
            # names stays, though the frontier (at the throughput batch) has it off
            recommended = recommend(entries, timed, cfg.latency_batch, retime_rounds=2 * cfg.timing_rounds)
            if run.searched:
                chosen = {recommended["latency"], recommended["throughput"]} if recommended else set()
                entries, dropped = drop_off_frontier(entries, keep=chosen)
                for row in dropped:
                    timed.drop(row["name"])
            report_on_test(entries, timed, testset, loaded, cfg, why_not, baseline, kind)  # every choice is made
            if kind.get("output_kind", "logits") != "logits":
                notes.append(f"the model's output holds {kind['output_kind']} ({kind['output_kind_from']}): "
                             f"/predict, the protocol's probabilities and the gate read them as they are, never "
                             f"through a second softmax or sigmoid")
            del timed  # the sessions close once nothing holds them
            notes += int8_comparison(entries, cfg.latency_batch)
            notes += device_note(entries)
        with log.step(f"write {out}"):
            manifest = build_manifest(loaded, data, entries, recommended, cfg, why_not, notes, len(valset.images),
                                      len(testset.images))
            manifest["baseline"] = baseline
            manifest.update(kind)
            manifest["skipped"] = skipped
            if timed_lengths:
                manifest["timed_text_lengths"] = timed_lengths
            if timing_drawn:
                manifest["timing_texts"] = {**timing_drawn, "headline_tokens": headline_tokens}
            if length_batches:
                manifest["seq_lengths"] = {"batch": cfg.latency_batch, "timed": [int(n) for n in length_batches],
                                           "skipped": skipped_lengths, "rows": ROWS_OF_LENGTH,
                                           "headline_tokens": headline_tokens}
            if run.searched:
                n = str(cfg.latency_batch)
                manifest["search"] = {"ratios": list(pruning_ratios(cfg)), "minutes": cfg.search_minutes,
                                      "transforms": run.search_transforms,
                                      "frontier": [e["name"] for e in sorted(entries, key=lambda e: e["latency_ms"][n])
                                                   if e["frontier"]["on"]],
                                      "dropped": dropped}
            manifest["failed"] = attempts.failed
            _sweep(stage, entries, also=[loaded.input.tokenizer] if form == "text" else [])
            artifacts.write_manifest(stage, manifest)
            (stage / "report.md").write_text(render_report(manifest))
            if run.searched:
                (stage / FRONTIER_PLOT).write_text(render_frontier(manifest))
    if run.searched:  # published: what an interrupted search kept is no longer needed
        clear_cache(out)
    return manifest


def _sweep(stage: Path, entries: list[dict], also: list[str]) -> None:
    """Remove from the folder to be published what no published variant uses: what a pass that
    failed had written, the files of a variant that could not run or be judged, the openvino-int8
    flow that lost (an IR another variant shares stays; the tracebacks in LOG_FILE stay, and the
    files every variant shares, `also`: a text model's tokenizer)."""
    keep = {LOG_FILE, *also} | {f for e in entries for f in (e["file"], *(e.get("companions") or {}))}
    for path in stage.iterdir():
        if path.name in keep:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
