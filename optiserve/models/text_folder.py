"""A Hugging Face model folder as a text model: `config.json`, the weights in `model.safetensors`
(never an unpickled file), `tokenizer.json`; a sentence-transformers folder adds `modules.json`
with its pooling (`1_Pooling/config.json`) and normalisation (`2_Normalize`), used as the folder
says. Nothing is downloaded: a hub name is one line asking for a folder.

What the folder is read into (`TextFolder`) says what the model is for: a sentence encoder (a
sentence-transformers folder, or a bare encoder with mean pooling stated) is a `text-embedding`
model, whose output is the pooled vector; an `...ForSequenceClassification` architecture is a
`text-classification` model, whose output is the logits over `config.json`'s `id2label`, or where
its `problem_type` is `multi_label_classification` their sigmoids, each class on its own (what
transformers' BCEWithLogitsLoss trains). The module built from it (`build_text_module`) takes one
token batch [N, 3, L] (optiserve.text_input)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from optiserve.errors import UserError, first_line
from optiserve.text_input import MASK, POOLING_MODES, TOKEN_INPUTS, TextInput

CONFIG, WEIGHTS, TOKENIZER, MODULES = "config.json", "model.safetensors", "tokenizer.json", "modules.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "model.pt", "model.pth")
# sentence-transformers' pooling modes, in the order it concatenates them (its Pooling module's)
POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
ENCODER_TASK, CLASSIFIER_TASK = "text-embedding", "text-classification"
OUTPUT_NAMES = {ENCODER_TASK: "sentence_embedding", CLASSIFIER_TASK: "logits"}  # the graph's output, as exported
MULTI_LABEL_OUTPUT = "probabilities"  # a multi-label classifier's output: its logits' sigmoids
MULTI_LABEL = "multi_label_classification"  # config.json's problem_type for independent sigmoids


@dataclass
class TextFolder:
    """What a model folder says about its model."""

    path: Path
    config: dict
    task: str                               # ENCODER_TASK | CLASSIFIER_TASK
    input: TextInput
    pooling: tuple[str, ...] = ()           # an encoder's pooling modes, concatenated in this order
    normalize: bool = False                 # an encoder's vectors scaled to unit length
    labels: list[str] | None = None         # a classifier's classes, from id2label
    notes: list[str] = field(default_factory=list)
    multi_label: bool = False               # a classifier's classes each on its own (sigmoids, not one softmax)

    @property
    def width(self) -> int:
        """The output's width: the vector's dimensions, or the classes."""
        if self.task == CLASSIFIER_TASK:
            return len(self.labels or [])
        return len(self.pooling) * int(self.config["hidden_size"])

    @property
    def output_name(self) -> str:
        """The graph's output, as exported: what the module returns."""
        return MULTI_LABEL_OUTPUT if self.multi_label else OUTPUT_NAMES[self.task]

    def facts(self) -> dict:
        """What the manifest records of the folder: where each reading came from."""
        return {"architecture": (self.config.get("architectures") or [self.config.get("model_type")])[0],
                "model_type": self.config.get("model_type"), "pooling": list(self.pooling),
                **({"problem_type": MULTI_LABEL} if self.multi_label else {}),
                "normalize": self.normalize, "max_length": self.input.max_length}


def is_text_folder(model: str) -> bool:
    """Whether MODEL is a folder holding a Hugging Face model (its config.json beside a tokenizer.json)."""
    path = Path(model)
    return path.is_dir() and (path / CONFIG).is_file() and (path / TOKENIZER).is_file()


def read_text_folder(model: str | Path) -> TextFolder:
    """The folder's model, or one line saying what is missing and what to give instead."""
    path = Path(model)
    if not path.is_dir():
        raise UserError(f"{model} is not a folder; give a Hugging Face model folder (config.json, model.safetensors, "
                        f"tokenizer.json): nothing is downloaded, so a hub name must be fetched first (e.g. "
                        f"`huggingface-cli download NAME --local-dir DIR`)")
    config = _json(path / CONFIG, "the model's configuration")
    if not (path / TOKENIZER).is_file():
        raise UserError(f"{path} has no {TOKENIZER}: the server tokenizes with it; save the model's fast tokenizer "
                        f"there (tokenizer.save_pretrained)")
    if not (path / WEIGHTS).is_file():
        pickled = [name for name in PICKLED_WEIGHTS if (path / name).is_file()]
        hint = (f"{pickled[0]} is a pickle, which optiserve never loads (it can run code); " if pickled else "")
        raise UserError(f"{path} has no {WEIGHTS}: {hint}save the model with safetensors "
                        f"(model.save_pretrained(DIR, safe_serialization=True))")
    architecture = (config.get("architectures") or [""])[0]
    modules = _modules(path)
    notes: list[str] = []
    multi_label = False
    if architecture.endswith("ForSequenceClassification"):
        labels = _labels(config, path)
        multi_label = is_multi_label(config, path, len(labels))
        task, pooling, normalize = CLASSIFIER_TASK, (), False
    else:
        labels = None
        task = ENCODER_TASK
        pooling, normalize = _pooling(path, modules, config, notes)
    max_length = _max_length(path, config)
    inputs = ("input_ids", "attention_mask") + (("token_type_ids",) if config.get("type_vocab_size", 0) > 0 else ())
    return TextFolder(path, config, task, TextInput(TOKENIZER, max_length, inputs), pooling, normalize, labels, notes,
                      multi_label)


def _json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path.parent} has no {path.name} ({what}): give a Hugging Face model folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} cannot be read as JSON ({what}): {e}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} holds {type(value).__name__}, not an object ({what})")
    return value


def _modules(path: Path) -> list[dict]:
    """A sentence-transformers folder's modules.json (the module types in order), or [] for a bare model."""
    if not (path / MODULES).is_file():
        return []
    try:
        modules = json.loads((path / MODULES).read_text(encoding="utf-8"))
        return [{"type": str(m["type"]), "path": str(m.get("path", ""))} for m in modules]
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError) as e:
        raise UserError(f"{path / MODULES} is not a sentence-transformers module list ({e})") from None


def _pooling(path: Path, modules: list[dict], config: dict, notes: list[str]) -> tuple[tuple[str, ...], bool]:
    """An encoder's pooling modes and whether its vectors are normalised, as its modules say."""
    kinds = [m["type"].rpartition(".")[2] for m in modules]
    if not modules:
        notes.append("no modules.json: the token vectors are mean-pooled over the text's tokens, unnormalised "
                     "(what sentence-transformers does with a bare encoder)")
        return ("mean",), False
    unknown = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if unknown:
        raise UserError(f"{path / MODULES} holds modules optiserve does not build ({', '.join(unknown)}); it builds "
                        f"Transformer, Pooling and Normalize")
    if "Pooling" not in kinds:
        raise UserError(f"{path / MODULES} has no Pooling module: a sentence encoder pools its token vectors")
    pooling_dir = path / modules[kinds.index("Pooling")]["path"]
    settings = _json(pooling_dir / "config.json", "the pooling settings")
    if "pooling_mode" in settings:
        given = settings["pooling_mode"]
        modes = tuple([given] if isinstance(given, str) else given)
    else:
        modes = tuple(mode for key, mode in POOLING_KEYS.items() if settings.get(key))
    if not modes:
        raise UserError(f"{pooling_dir / 'config.json'} turns no pooling mode on")
    unbuilt = [m for m in modes if m not in POOLING_MODES]
    if unbuilt:
        raise UserError(f"{pooling_dir / 'config.json'} pools by {', '.join(unbuilt)}; optiserve builds "
                        f"{', '.join(POOLING_MODES)}")
    if settings.get("include_prompt") is False:
        raise UserError(f"{pooling_dir / 'config.json'} leaves the prompt out of pooling, which optiserve does not build")
    dimension = settings.get("word_embedding_dimension")
    if dimension is not None and int(dimension) != int(config.get("hidden_size", dimension)):
        raise UserError(f"{pooling_dir / 'config.json'} pools {dimension}-wide token vectors; config.json's "
                        f"hidden_size is {config.get('hidden_size')}")
    return modes, "Normalize" in kinds


def _max_length(path: Path, config: dict) -> int:
    """The most tokens a text keeps: sentence-transformers' max_seq_length where the folder sets it,
    else the tokenizer's model_max_length, never past the model's position embeddings."""
    positions = int(config.get("max_position_embeddings") or 512)
    given = None
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        if (path / name).is_file():
            value = _json(path / name, "the tokenizer's settings").get(key)
            if isinstance(value, int) and 1 < value:
                given = value
                break
    return min(given or positions, positions)


def _labels(config: dict, path: Path) -> list[str]:
    id2label = config.get("id2label") or {}
    try:
        ordered = sorted(((int(k), str(v)) for k, v in id2label.items()))
    except (ValueError, AttributeError):
        raise UserError(f"{path / CONFIG}: id2label must map class indices to names") from None
    width = int(config.get("num_labels") or len(ordered))
    if [k for k, _ in ordered] != list(range(width)):
        return [str(i) for i in range(width)]
    return [name for _, name in ordered]


def is_multi_label(config: dict, path: Path, width: int) -> bool:
    """Whether a sequence classifier's classes are each on its own (`problem_type`
    multi_label_classification: a sigmoid per logit) rather than one softmax over them; one line for
    a regressor's scores (`problem_type` regression, or fewer than two labels: transformers reads
    one label as regression)."""
    problem = config.get("problem_type")
    if problem == "regression" or width < 2:
        said = "problem_type is regression" if problem == "regression" else f"{width} label{'' if width == 1 else 's'}"
        raise UserError(f"{path / CONFIG}: {said}: a regressor's scores, not classes; optiserve classifies texts over "
                        f"two or more classes")
    return problem == MULTI_LABEL


# --- the module ------------------------------------------------------------------------------------

class TextModule(nn.Module):
    """A Hugging Face encoder as one module on a token batch [N, 3, L]: the pooled vector (normalised
    where the folder says so) of an encoder, the logits of a classifier (a multi-label one's sigmoids:
    the graph then ends in the sigmoid, which is how its scores are read as multi-label)."""

    def __init__(self, model: nn.Module, folder: TextFolder):
        super().__init__()
        self.model = model
        self.inputs = tuple(TOKEN_INPUTS.index(name) for name in folder.input.inputs)
        self.names = folder.input.inputs
        self.pooling = folder.pooling
        self.normalize = folder.normalize
        self.classifier = folder.task == CLASSIFIER_TASK
        self.multi_label = folder.multi_label

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The output of a token batch [N, 3, L], run up to its last column any text fills (rows taken
        from a dataset are padded to the longest of them all; padding is masked, so cutting it changes nothing)."""
        filled = tokens[:, MASK].any(dim=0).nonzero()
        end = int(filled.max()) + 1 if len(filled) else tokens.shape[2]
        return self.run(*(tokens[:, i, :end] for i in self.inputs))

    def run(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The output from the graph's own inputs (`names`, in order): what ONNX exports."""
        feeds = dict(zip(self.names, inputs))
        out = self.model(**feeds, return_dict=True)
        if self.classifier:
            return torch.sigmoid(out.logits) if self.multi_label else out.logits
        hidden = out.last_hidden_state
        mask = feeds["attention_mask"] if "attention_mask" in feeds else torch.ones_like(feeds["input_ids"])
        vectors = torch.cat([pool(mode, hidden, mask) for mode in self.pooling], dim=-1)
        return nn.functional.normalize(vectors, p=2, dim=1) if self.normalize else vectors


def pool(mode: str, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One pooling mode of token vectors [N, L, D] under an attention mask [N, L], as sentence-transformers pools."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
    total = (hidden * weights).sum(dim=1)
    count = weights.sum(dim=1).clamp(min=1e-9)
    return total / (count if mode == "mean" else count.sqrt())


def build_text_module(folder: TextFolder) -> TextModule:
    """The folder's model with its weights (read by safetensors), in eval mode; a weight the
    architecture lacks, or one it needs and the file lacks, is one line."""
    try:
        import transformers
        from safetensors.torch import load_file
    except ImportError as e:
        raise UserError(f"text models need {e.name}: pip install 'optiserve[text]'") from None

    builder = transformers.AutoModelForSequenceClassification if folder.task == CLASSIFIER_TASK else transformers.AutoModel
    try:
        config = transformers.AutoConfig.for_model(**{k: v for k, v in folder.config.items()
                                                      if k not in ("architectures", "_name_or_path")})
        config.architectures = folder.config.get("architectures")
        model = builder.from_config(config, attn_implementation="eager")
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{folder.path / CONFIG}: transformers cannot build this model "
                        f"({first_line(e, limit=200)})") from None
    try:
        state = load_file(str(folder.path / WEIGHTS))
    except Exception as e:  # noqa: BLE001  safetensors' own error type, raised on a damaged file
        raise UserError(f"{folder.path / WEIGHTS} cannot be read as safetensors ({first_line(e, limit=200)})") from None
    own = model.state_dict()
    prefix = model.base_model_prefix + "."
    if folder.task == ENCODER_TASK and not (set(state) & set(own)):  # saved from a model with a head
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    elif folder.task == CLASSIFIER_TASK and not (set(state) & set(own)):  # saved from the bare encoder
        state = {prefix + k: v for k, v in state.items()}
    missing = [k for k in own if k not in state and not k.endswith("position_ids")]
    unused = [k for k in state if k not in own and not k.endswith("position_ids")]
    if missing:
        raise UserError(f"{folder.path / WEIGHTS} lacks {len(missing)} of the model's weights ({', '.join(missing[:3])}"
                        f"{', ...' if len(missing) > 3 else ''}): it was not saved from this config.json's model")
    if unused:
        folder.notes.append(f"{len(unused)} weights of {WEIGHTS} are not the model's and were left out "
                            f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''})")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    return TextModule(model.eval(), folder).eval()


def load_text_model(name: str, weights: str | None, labels: list[str] | None, task: str | None, input_spec,
                    overrides, num_classes: int | None) -> "LoadedModel":
    """A text model folder as the optimizer takes a model (through its registered source): its module,
    input, task and classes, all as the folder says; flags that would say otherwise are refused in one line."""
    from optiserve.files import sha256_file
    from optiserve.models.sources import find_source
    from optiserve.models.weights import InputOverrides, LoadedModel

    if weights is not None:
        raise UserError(f"--weights: {name} holds its own weights ({WEIGHTS}); give the folder alone")
    if input_spec is not None or overrides != InputOverrides():
        raise UserError(f"--input-shape, --mean, --std and --resize describe images; {name} is a text model, whose "
                        f"input its tokenizer says")
    if labels:
        raise UserError(f"--labels: {name}'s classes are config.json's id2label")
    folder = read_text_folder(name)
    if task is not None and task != folder.task:
        said = "config.json's architecture" if folder.task == CLASSIFIER_TASK else "folder"
        raise UserError(f"{name} is a {folder.task} model, as its {said} says; --task {task} does not fit it")
    built = find_source(name).build(name, num_classes, None)
    source = {"weights": str(folder.path / WEIGHTS), "sha256": sha256_file(folder.path / WEIGHTS), **built.facts}
    output = {"name": folder.output_name, "dtype": "float32", "shape": [folder.width]}
    return LoadedModel(name, built.module, folder.input, built.classes or [], source, task=folder.task,
                       output_width=folder.width, outputs=[output], tokenizer_folder=folder.path)
