"""An ONNX file of a text encoder or text classifier, with its tokenizer's folder (`--tokenizer DIR`).

What the file takes and gives is read from its graph: its token inputs (`input_ids`, optionally
`attention_mask` and `token_type_ids`, int64 or int32, batch and sequence axes dynamic) and the output
the task reads (the first, or `--task-output`). A per-token output [N, T, H] is pooled as DIR's
sentence-transformers modules say (modules.json, 1_Pooling/config.json, Normalize); without them it
is one line asking for them, never a guessed pooling. An [N, W] output is a sentence embedding as it
is, or a classifier's scores where DIR's config.json says so (a ...ForSequenceClassification
architecture, or an id2label of W classes) or `--task text-classification` does. DIR also gives the
longest text kept (sentence_bert_config.json, tokenizer_config.json, config.json's positions).

Where the file needs it, its graph is adapted inside (the file every variant is built from and served
as): int32 inputs take int64 through a Cast, the pooling (and normalisation) is appended, and the
outputs no task reads are dropped with the nodes only they used."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from optiserve.errors import UserError, first_line
from optiserve.models.onnx_file import (TOKEN_DTYPES, ModelOutput, fed_inputs, graph_outputs, show_inputs, show_shape,
                                        takes_tokens, value_dtype, value_shape)
from optiserve.models.onnx_graph import GraphEdit, renamed_uses
from optiserve.models.text_folder import (CLASSIFIER_TASK, CONFIG, ENCODER_TASK, OUTPUT_NAMES, TOKENIZER,
                                          _json, _labels, _max_length, _modules, _pooling, is_multi_label)
from optiserve.text_input import TOKEN_INPUTS, TextInput

INT64, FLOAT, INT32 = 7, 1, 6  # onnx.TensorProto's element types
PREFIX = "optiserve/text"      # the names of the nodes added to the graph begin so


def tokenizer_folder(given: str | Path) -> Path:
    """`--tokenizer DIR` checked: a folder holding tokenizer.json, or one line saying what to give."""
    path = Path(given)
    if not path.is_dir():
        raise UserError(f"--tokenizer {given} is not a folder; give the folder holding the model's tokenizer.json "
                        f"(tokenizer.save_pretrained(DIR))")
    if not (path / TOKENIZER).is_file():
        raise UserError(f"--tokenizer {given} has no {TOKENIZER}: save the model's fast tokenizer there "
                        f"(tokenizer.save_pretrained(DIR))")
    return path


def load_text_onnx(name: str, tokenizer: str | Path, task: str | None, task_output: str | None):
    """The file as the optimizer takes a model (models.LoadedModel, its `file` the graph every variant is
    built from), or one line saying why it cannot be."""
    import onnx

    from optiserve.models.weights import LoadedModel

    folder = tokenizer_folder(tokenizer)
    path = Path(name)
    if not path.is_file():
        raise UserError(f"ONNX file {name} does not exist")
    try:
        proto = onnx.load(str(path))
    except Exception as e:  # noqa: BLE001  onnx's own reason, whatever it is
        raise UserError(f"cannot read {name} as ONNX: {first_line(e)}") from None
    inputs = fed_inputs(proto)
    if not takes_tokens(inputs):
        raise UserError(f"--tokenizer is for a text model; {name} takes {show_inputs(inputs)}, not token inputs "
                        f"(input_ids, attention_mask, token_type_ids): drop --tokenizer")
    names = _check_inputs(inputs, name)
    given = {i.name: value_dtype(i) for i in inputs}  # as the file has them, before any is fed int64
    outputs = graph_outputs(proto, path)
    read = _task_output(outputs, task_output, name)
    config = _json(folder / CONFIG, "the model's configuration") if (folder / CONFIG).is_file() else {}
    notes: list[str] = []
    task, labels, pooling, normalize = _reading(read, task, config, folder, name, notes)
    width = read.shape[-1] * (len(pooling) or 1)
    feeds = names + (("attention_mask",) if pooling and "attention_mask" not in names else ())
    model_input = TextInput(TOKENIZER, _max_length(folder, config), feeds)

    edit = GraphEdit(proto, PREFIX)
    added = _as_int64(proto, edit, inputs)
    if len(feeds) > len(names):
        _add_mask_input(proto, inputs)
        added.append("an attention_mask input, for the pooling")
    output = read.name
    if pooling:
        output = _append_pooling(proto, edit, read, pooling, normalize)
        added.append(f"{'+'.join(pooling)} pooling of {read.name!r}{', normalised' if normalize else ''}")
    dropped = [o.name for o in outputs if o.name != read.name]
    if dropped:
        added.append(f"outputs {', '.join(dropped)} dropped (no task reads them)")
    _place(proto, edit)
    _keep_only(proto, output)

    file, keep = path, None
    if added:
        from optiserve.models.onnx_adapt import AdaptedGraph

        file, keep = AdaptedGraph(proto, {"text_inputs_adapted": "; ".join(added)}).write()
    facts = {"inputs": given, "output": read.name,
             "output_shape": show_shape(read.shape), "pooling": list(pooling), "normalize": normalize,
             "max_length": model_input.max_length, "added": added}
    from optiserve.files import sha256_file

    source = {"weights": "in the file", "source": "onnx", "sha256": sha256_file(path), "opset": _opset(proto),
              "text_onnx": facts, "tokenizer": str(folder / TOKENIZER), "notes": notes}
    return LoadedModel(name, None, model_input, labels or [], source, task=task, output_width=width, file=file,
                       outputs=[{"name": output, "dtype": "float32", "shape": [width]}], keep=keep,
                       tokenizer_folder=folder)


def _check_inputs(inputs: list, name: str) -> tuple[str, ...]:
    """The graph's token inputs by name, in its order: each one of TOKEN_INPUTS, an integer matrix
    [N, L] with both axes dynamic (a batch is padded to its longest text)."""
    unknown = [i.name for i in inputs if i.name not in TOKEN_INPUTS]
    if unknown or not any(i.name == "input_ids" for i in inputs):
        raise UserError(f"{name} takes {show_inputs(inputs)}; optiserve feeds a text model by name: input_ids, and "
                        f"optionally attention_mask and token_type_ids (export it with those input names)")
    for i in inputs:
        shape, dtype = value_shape(i), value_dtype(i)
        if dtype not in TOKEN_DTYPES or len(shape) != 2:
            raise UserError(f"{name}: input {i.name} is {dtype} {show_shape(shape)}; a token input is int64 or int32 "
                            f"[batch, sequence]")
        if shape[0] is not None or shape[1] is not None:
            raise UserError(f"{name}: input {i.name} has shape {show_shape(shape)}; its batch and sequence axes must "
                            f"be dynamic (a batch is padded to its longest text): export it with dynamic_axes="
                            f"{{'{i.name}': {{0: 'batch', 1: 'sequence'}}}}")
    return tuple(i.name for i in inputs)


def _task_output(outputs: tuple[ModelOutput, ...], task_output: str | None, name: str) -> ModelOutput:
    if task_output is None:
        return outputs[0]
    found = [o for o in outputs if o.name == task_output]
    if not found:
        raise UserError(f"--task-output {task_output!r}: {name} has no such output; its outputs: "
                        f"{', '.join(o.name for o in outputs)}")
    return found[0]


def _reading(read: ModelOutput, task: str | None, config: dict, folder: Path, name: str,
             notes: list[str]) -> tuple[str, list[str] | None, tuple[str, ...], bool]:
    """(task, classes, pooling modes, normalised) as the output's shape and DIR say."""
    which = f"{name}'s output {read.name!r} {show_shape(read.shape)}"
    if not read.dtype.startswith("float"):
        raise UserError(f"{which} holds {read.dtype}; a text model's output is floating-point (name another with "
                        f"--task-output)")
    if len(read.shape) == 3 and isinstance(read.shape[2], int):
        if task == CLASSIFIER_TASK:
            raise UserError(f"{which} holds a vector per token, not class scores: a text classifier's output is "
                            f"[N, K] (name it with --task-output)")
        modules = _modules(folder)
        if not any(m["type"].rpartition(".")[2] == "Pooling" for m in modules):
            raise UserError(f"{which} holds a vector per token, and --tokenizer {folder} says how to pool them into "
                            f"one per text only through sentence-transformers' modules.json and 1_Pooling/config.json"
                            f", which it lacks: save them there (SentenceTransformer.save), or export the pooled "
                            f"output")
        pooling, normalize = _pooling(folder, modules, config, notes)
        return ENCODER_TASK, None, pooling, normalize
    if len(read.shape) != 2 or not isinstance(read.shape[1], int):
        raise UserError(f"{which}: a text model's output is [N, W] (a sentence embedding, or a classifier's scores) "
                        f"or [N, T, H] (token vectors, pooled as DIR's sentence-transformers modules say), with its "
                        f"last axis fixed")
    width = read.shape[1]
    id2label = config.get("id2label") or {}
    architecture = (config.get("architectures") or [""])[0]
    classifier = task == CLASSIFIER_TASK or (task is None and (architecture.endswith("ForSequenceClassification")
                                                               or len(id2label) == width))
    if not classifier:
        notes.append(f"{read.name!r} {show_shape(read.shape)} is the sentence embedding, served as the graph gives it")
        return ENCODER_TASK, None, (), False
    if id2label and len(id2label) != width:
        raise UserError(f"{folder / CONFIG}: id2label names {len(id2label)} classes; {which} scores {width}")
    labels = _labels({**config, "num_labels": width}, folder)
    if is_multi_label(config, folder, width):
        raise UserError(f"{folder / CONFIG}: problem_type is multi_label_classification; optiserve reads a multi-label "
                        f"text classifier from its model folder (config.json, model.safetensors), not yet from an "
                        f"ONNX file of its logits: give the folder")
    return CLASSIFIER_TASK, labels, (), False


def _opset(proto) -> int:
    from optiserve.models.onnx_opset import default_opset

    return default_opset(proto)


def _as_int64(proto, edit: GraphEdit, inputs: list) -> list[str]:
    """Each int32 token input fed int64 under its own name, cast to int32 inside (the runtimes feed int64)."""
    added = []
    for i in inputs:
        if value_dtype(i) != "int32":
            continue
        inner = f"{i.name}/as_in_file"
        renamed_uses(proto.graph, i.name, inner)
        edit.op("Cast", [i.name], [inner], to=INT32)
        i.type.tensor_type.elem_type = INT64
        added.append(f"{i.name} fed int64, cast to int32")
    return added


def _add_mask_input(proto, inputs: list) -> None:
    """An attention_mask input [batch, sequence] beside input_ids, read only by the appended pooling."""
    from onnx import helper

    ids = next(i for i in inputs if i.name == "input_ids")
    mask = helper.make_tensor_value_info("attention_mask", INT64, None)
    for d in ids.type.tensor_type.shape.dim:
        mask.type.tensor_type.shape.dim.add().CopyFrom(d)
    proto.graph.input.append(mask)


def _reduce(edit: GraphEdit, op: str, x: str, keepdims: int) -> str:
    """`op` (ReduceSum, ReduceMax) over axis 1, its axes an attribute or an input as the graph's opset has it."""
    since = {"ReduceSum": 13, "ReduceMax": 18}[op]
    if _opset(edit.model) >= since:
        return edit.op(op, [x, edit.const([1], np.int64)], keepdims=keepdims)
    return edit.op(op, [x], axes=[1], keepdims=keepdims)


def _append_pooling(proto, edit: GraphEdit, read: ModelOutput, modes: tuple[str, ...], normalize: bool) -> str:
    """The token vectors [N, T, H] pooled under the attention mask as sentence-transformers pools
    (models.text_folder.pool), its modes concatenated, normalised to unit length where asked: the
    graph's output `sentence_embedding` [N, len(modes) * H]."""
    from onnx import helper

    output = OUTPUT_NAMES[ENCODER_TASK]
    taken = {n for node in proto.graph.node for n in node.output} | {v.name for v in proto.graph.input}
    if output in taken:
        raise UserError(f"the graph already has a tensor named {output!r}; if it is the pooled vector, name it with "
                        f"--task-output {output}")
    hidden = read.name
    declared = next(o for o in proto.graph.output if o.name == read.name)
    if declared.type.tensor_type.elem_type != FLOAT:
        hidden = edit.op("Cast", [hidden], to=FLOAT)
    mask = edit.reshape(edit.op("Cast", ["attention_mask"], to=FLOAT), [0, 0, 1])  # [N, T, 1]
    pooled = []
    total = count = None
    for mode in modes:
        if mode == "cls":
            pooled.append(edit.op("Gather", [hidden, edit.const(0, np.int64)], axis=1))
        elif mode == "max":
            masked = edit.op("Where", [edit.op("Equal", [mask, edit.const(0.0)]), edit.const(-np.inf), hidden])
            pooled.append(_reduce(edit, "ReduceMax", masked, 0))
        else:
            if total is None:
                total = _reduce(edit, "ReduceSum", edit.op("Mul", [hidden, mask]), 0)
                count = edit.op("Max", [_reduce(edit, "ReduceSum", mask, 0), edit.const(1e-9)])
            pooled.append(edit.op("Div", [total, count if mode == "mean" else edit.op("Sqrt", [count])]))
    vector = pooled[0] if len(pooled) == 1 else edit.op("Concat", pooled, axis=1)
    if normalize:  # torch.nn.functional.normalize: x / max(|x|, 1e-12)
        norm = edit.op("Sqrt", [_reduce(edit, "ReduceSum", edit.op("Mul", [vector, vector]), 1)])
        vector = edit.op("Div", [vector, edit.op("Max", [norm, edit.const(1e-12)])])
    edit.op("Identity", [vector], [output])
    out = helper.make_tensor_value_info(output, FLOAT, None)
    batch = out.type.tensor_type.shape.dim.add()
    batch.CopyFrom(declared.type.tensor_type.shape.dim[0])
    out.type.tensor_type.shape.dim.add().dim_value = len(modes) * read.shape[2]
    proto.graph.output.append(out)
    return output


def _place(proto, edit: GraphEdit) -> None:
    """The added nodes in the graph: the casts before its own nodes, the pooling after them."""
    first = [n for n in edit.nodes if n.op_type == "Cast" and n.output[0].endswith("/as_in_file")]
    last = [n for n in edit.nodes if n not in first]
    nodes = list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend([*first, *nodes, *last])


def _keep_only(proto, output: str) -> None:
    """`output` the graph's one output: the other outputs, and the nodes and weights only they used, dropped."""
    graph = proto.graph
    kept_outputs = [o for o in graph.output if o.name == output]
    del graph.output[:]
    graph.output.extend(kept_outputs)
    needed, kept = {output}, []
    for node in reversed(list(graph.node)):
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(_reads(node))
    if len(kept) == len(graph.node):
        return
    del graph.node[:]
    graph.node.extend(reversed(kept))
    weights = [i for i in graph.initializer if i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(weights)
    infos = [v for v in graph.value_info if v.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(infos)


def _reads(node) -> set[str]:
    """Every name `node` reads, those its subgraphs (If, Loop, Scan) read from outside included."""
    names = set(node.input)
    for attribute in node.attribute:
        for sub in [attribute.g, *attribute.graphs] if attribute.type in (5, 10) else []:
            for inner in sub.node:
                names |= _reads(inner)
    return names
