"""A user's own texts, for text models (`--dataset text:PATH`): one file split seeded into the three
roles (stratified by label where labelled), or a folder of train.EXT, val.EXT and test.EXT files used
as given (with only one held-out file, it is halved into a validation half that chooses and a test
half that reports, as an image folder's ImageNet layout is).

The file's extension says its format:
  .txt          one text a line, blank lines skipped; where every line starts with fastText's
                `__label__NAME `, labelled (NAME the label, the rest the text)
  .tsv / .csv   a header row, then tab- / comma-separated rows (Python's `csv` quoting): columns
                `text` (and optionally `label`), or `text1`, `text2` and `score` (scored pairs);
                other columns are ignored. A `label` holding `|` names several classes of one
                text (`sports|politics`, for a multi-label classifier): where any row's does, every
                row's label is a set of classes (one name is a set of one), and the file is split
                at random rather than by label
Files are UTF-8 (a byte-order mark is tolerated); anything else is refused with the command that
converts it, rather than guessed."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from optiserve.data.partition import random_split, split_in_halves, stratified_split
from optiserve.errors import UserError

DELIMITERS = {".txt": None, ".tsv": "\t", ".csv": ","}  # the formats, by extension
FASTTEXT_LABEL = "__label__"
LABEL_SEPARATOR = "|"  # between the classes of one text in a multi-labelled table's `label` column
ROLES = ("train", "val", "test")
EXPECTED_COLUMNS = "a header row with `text` (and optionally `label`), or `text1`, `text2` and `score`"
MIN_PER_CLASS, MIN_UNLABELLED = 5, 10  # as an image folder: enough for each role to hold some


@dataclass
class TextFile:
    """What one file holds, before any split: labels are names, as written."""

    kind: str                             # "texts" | "labelled" | "multilabelled" | "pairs"
    texts: list[str]                      # pairs: the first texts
    labels: list | None = None            # a name per text; multilabelled: a tuple of names per text
    second: list[str] | None = None       # pairs: the second texts
    scores: np.ndarray | None = None      # pairs: float scores

    def __len__(self) -> int:
        return len(self.texts)


@dataclass
class TextExamples:
    """One role's examples."""

    texts: list[str]                      # pairs: the first texts
    labels: list | None = None            # class indices into TextSplits.classes; multilabelled: a list per text
    second: list[str] | None = None       # pairs: the second texts
    scores: np.ndarray | None = None      # pairs: float scores

    def __len__(self) -> int:
        return len(self.texts)


@dataclass
class TextSplits:
    """Three disjoint roles that never mix, as DatasetSplits': `train` fits (calibration,
    distillation), `val` chooses, `test` only reports."""

    name: str
    train: TextExamples
    val: TextExamples
    test: TextExamples
    classes: list[str]   # sorted label names; [] when unlabelled or pairs
    kind: str            # "texts" | "labelled" | "multilabelled" | "pairs"
    how: str             # one sentence: where each role came from


def _decoded(path: Path) -> str:
    """The file's text, read as UTF-8 strictly (a byte-order mark dropped)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read text file {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{path} is not UTF-8 (byte 0x{data[e.start]:02x} on line {line}); convert it, e.g. "
                        f"iconv -f cp1252 -t utf-8 {path} > {path.stem}-utf8{path.suffix}") from None


def _read_lines(path: Path, content: str) -> TextFile:
    """A .txt file: one text a line; labelled where every line has fastText's `__label__NAME` prefix."""
    rows = [(n, line.strip()) for n, line in enumerate(io.StringIO(content), 1) if line.strip()]
    if not rows:
        raise UserError(f"{path} holds no texts (one text a line is expected)")
    first_labelled = rows[0][1].startswith(FASTTEXT_LABEL)
    for n, line in rows:
        if line.startswith(FASTTEXT_LABEL) != first_labelled:
            raise UserError(f"{path}: line {n} {'has no' if first_labelled else 'has a'} {FASTTEXT_LABEL} prefix but "
                            f"line {rows[0][0]} {'has one' if first_labelled else 'has none'}; label every line "
                            f"(__label__NAME TEXT) or none")
    if not first_labelled:
        return TextFile("texts", [line for _, line in rows])
    texts, labels = [], []
    for n, line in rows:
        body = line[len(FASTTEXT_LABEL):]
        label, text = (body.split(None, 1) + [""])[:2] if body[:1].strip() else ("", "")
        if not text.strip():
            raise UserError(f"{path}: line {n} is not `__label__NAME TEXT` (one label, then the text); "
                            f"write each labelled line so")
        if text.startswith(FASTTEXT_LABEL):
            raise UserError(f"{path}: line {n} has more than one label; one label a text is read from a .txt file "
                            f"(keep the first, or write a .tsv with a `label` column: a|b for several)")
        texts.append(text.strip())
        labels.append(label)
    return TextFile("labelled", texts, labels)


def _read_table(path: Path, content: str, delimiter: str) -> TextFile:
    """A .tsv or .csv file: a header row naming the columns, then one example a row."""
    reader = csv.reader(io.StringIO(content, newline=""), delimiter=delimiter)
    try:
        header = [name.strip() for name in next(reader, [])]
        rows = [(reader.line_num, row) for row in reader if row]
    except csv.Error as e:
        raise UserError(f"{path}: line {reader.line_num} cannot be read as {'TSV' if delimiter == chr(9) else 'CSV'} "
                        f"({e}); check its quotes") from None
    if not header:
        raise UserError(f"{path} is empty; it needs {EXPECTED_COLUMNS}, then one example a row")
    if {"text1", "text2", "score"} <= set(header):
        wanted = ["text1", "text2", "score"]
    elif "text" in header:
        wanted = ["text", "label"] if "label" in header else ["text"]
    else:
        raise UserError(f"{path}: its header row has columns {', '.join(repr(c) for c in header)}; "
                        f"expected {EXPECTED_COLUMNS}")
    if not rows:
        raise UserError(f"{path} has a header row but no examples; add one example a row")
    at = [header.index(name) for name in wanted]
    columns: list[list[str]] = [[] for _ in wanted]
    for n, row in rows:
        if len(row) != len(header):
            raise UserError(f"{path}: line {n} has {len(row)} field{'s' * (len(row) != 1)} but the header has "
                            f"{len(header)}; quote fields that hold the delimiter, or fill in the missing ones")
        for column, name, i in zip(columns, wanted, at):
            if not row[i].strip():
                raise UserError(f"{path}: line {n} has an empty {name!r}; fill it in or remove the row")
            column.append(row[i])
    if wanted[0] == "text":
        if len(wanted) == 1:
            return TextFile("texts", columns[0])
        if any(LABEL_SEPARATOR in label for label in columns[1]):
            return TextFile("multilabelled", columns[0], [_label_set(path, n, label)
                                                          for (n, _), label in zip(rows, columns[1])])
        return TextFile("labelled", columns[0], [label.strip() for label in columns[1]])
    scores = []
    for (n, _), value in zip(rows, columns[2]):
        try:
            score = float(value)
        except ValueError:
            score = math.nan
        if not math.isfinite(score):
            raise UserError(f"{path}: line {n} has score {value!r}; a score is a finite number (e.g. 0.75)")
        scores.append(score)
    return TextFile("pairs", columns[0], second=columns[1], scores=np.asarray(scores, dtype=np.float64))


def _label_set(path: Path, n: int, label: str) -> tuple[str, ...]:
    """A multi-labelled row's classes: its label's names between `|`, each once, in the order written."""
    names = [name.strip() for name in label.split(LABEL_SEPARATOR)]
    if not all(names):
        raise UserError(f"{path}: line {n} has label {label[:60]!r}, with an empty name between "
                        f"{LABEL_SEPARATOR!r}s; write the classes as a{LABEL_SEPARATOR}b")
    return tuple(dict.fromkeys(names))


def _as_sets(file: TextFile) -> TextFile:
    """A labelled file's labels as sets of one, beside a multi-labelled file's."""
    if file.kind != "labelled":
        return file
    return TextFile("multilabelled", file.texts, [(label,) for label in file.labels])


def _class_names(file: TextFile) -> set[str]:
    """Every class a file's labels name."""
    if file.kind == "multilabelled":
        return {name for names in file.labels for name in names}
    return set(file.labels or ())


def read_text_file(path: str | Path) -> TextFile:
    """One file's examples in its own order, in the format its extension names."""
    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if suffix not in DELIMITERS:
        raise UserError(f"{path}: a text dataset is a .txt (one text a line), .tsv or .csv file (a header row: "
                        f"text[,label] or text1,text2,score), not {suffix or 'a file without an extension'}")
    content = _decoded(path)
    if not content.strip():
        raise UserError(f"{path} is empty; it needs texts ({'one a line' if suffix == '.txt' else EXPECTED_COLUMNS})")
    return _read_lines(path, content) if DELIMITERS[suffix] is None else _read_table(path, content, DELIMITERS[suffix])


def _examples(file: TextFile, classes: list[str], idx=None) -> TextExamples:
    """`file`'s examples at `idx` (all of them when None), labels as indices into `classes`."""
    idx = range(len(file)) if idx is None else [int(i) for i in idx]
    index = {name: i for i, name in enumerate(classes)}
    label = ((lambda names: [index[name] for name in names]) if file.kind == "multilabelled" else index.__getitem__)
    return TextExamples([file.texts[i] for i in idx],
                        [label(file.labels[i]) for i in idx] if file.labels is not None else None,
                        [file.second[i] for i in idx] if file.second is not None else None,
                        file.scores[list(idx)] if file.scores is not None else None)


def _split_file(path: Path, seed: int) -> TextSplits:
    """One file split seeded in SPLIT_FRACTIONS proportions, stratified by label where labelled (one
    label a text; label sets are split at random)."""
    file = read_text_file(path)
    noun = "pairs" if file.kind == "pairs" else "texts"
    classes = sorted(_class_names(file))
    if file.kind == "labelled":
        counts = {c: file.labels.count(c) for c in classes}
        fewest = min(classes, key=counts.__getitem__)
        if counts[fewest] < MIN_PER_CLASS:
            raise UserError(f"{path}: label {fewest!r} has {counts[fewest]} texts; every label needs at least "
                            f"{MIN_PER_CLASS} to split into train/val/test (add texts, or give train/val/test files)")
        index = {name: i for i, name in enumerate(classes)}
        try:
            tr, va, te = stratified_split(np.asarray([index[label] for label in file.labels]), seed)
        except ValueError:  # each split holds every label: with many labels 5 texts each are too few
            raise UserError(f"{path}: {len(file)} texts with {len(classes)} labels cannot give every label a place "
                            f"in train, validation and test: give each label at least 10 texts, or give "
                            f"train/val/test files") from None
    else:
        if len(file) < MIN_UNLABELLED:
            raise UserError(f"{path}: {len(file)} {noun}; at least {MIN_UNLABELLED} are needed to split into "
                            f"train/val/test (add more, or give train/val/test files)")
        tr, va, te = random_split(len(file), seed)
    by = ", by label" if file.kind == "labelled" else ""
    how = (f"{path.name}'s {len(file)} {noun} were split (seed {seed}{by}) into "
           f"{len(tr)} train {noun} that fit, {len(va)} validation {noun} that choose and {len(te)} test {noun} "
           f"that report")
    return TextSplits(f"text:{path}", _examples(file, classes, tr), _examples(file, classes, va),
                      _examples(file, classes, te), classes, file.kind, how)


def _role_files(root: Path) -> dict[str, Path]:
    """The folder's train.EXT, val.EXT and test.EXT files, one each at most, of one format."""
    found: dict[str, Path] = {}
    try:
        entries = sorted(root.iterdir())
    except OSError as e:
        raise UserError(f"cannot read text dataset folder {root}: {e.strerror or e}") from None
    for p in entries:
        if p.is_file() and p.stem in ROLES and p.suffix.lower() in DELIMITERS:
            if p.stem in found:
                raise UserError(f"{root} holds {found[p.stem].name} and {p.name}; keep one {p.stem} file")
            found[p.stem] = p
    if "train" not in found or len(found) < 2:
        raise UserError(f"{root} holds {', '.join(sorted(p.name for p in found.values())) or 'no role files'}; a text "
                        f"dataset folder holds train.txt|.tsv|.csv with val.* and test.* (or one of them); or give "
                        f"one file, text:FILE, to be split")
    formats = {p.suffix.lower() for p in found.values()}
    if len(formats) > 1:
        raise UserError(f"{root}: {', '.join(p.name for p in found.values())} are in different formats; write "
                        f"them all as {found['train'].suffix}")
    return found


def _given_splits(root: Path, seed: int) -> TextSplits:
    """A folder's own role files, as given; with only one held-out file, it is halved (by label where
    labelled, seeded): the first half chooses, the second only reports."""
    paths = _role_files(root)
    files = {role: read_text_file(p) for role, p in paths.items()}
    if any(file.kind == "multilabelled" for file in files.values()):
        files = {role: _as_sets(file) for role, file in files.items()}
    train = files["train"]
    held_out = [role for role in ("val", "test") if role in files]
    # unlabelled texts may fit (calibration, distillation) where scored pairs choose and report
    kind = "pairs" if train.kind == "texts" and all(files[r].kind == "pairs" for r in held_out) else train.kind
    for role, file in files.items():
        if file.kind != train.kind and not (role != "train" and kind == "pairs" and train.kind == "texts"):
            raise UserError(f"{paths[role]} holds {file.kind} but {paths['train'].name} holds {train.kind}; "
                            f"write every file with the same columns (only scored pairs may be held out beside "
                            f"unlabelled training texts)")
    classes = sorted(_class_names(train))
    for role, file in files.items():
        unknown = sorted(_class_names(file) - set(classes))
        if unknown:
            raise UserError(f"{paths[role]} has labels {paths['train'].name} has not ({', '.join(unknown[:8])}); "
                            f"label every file with the same names")
    noun = "pairs" if kind == "pairs" else "texts"
    if len(held_out) == 2:
        val, test = _examples(files["val"], classes), _examples(files["test"], classes)
        how = (f"{root.name}'s own files, as given: {paths['train'].name} ({len(train)} "
               f"{'pairs' if train.kind == 'pairs' else 'texts'}) fits, "
               f"{paths['val'].name} ({len(files['val'])}) chooses and {paths['test'].name} ({len(files['test'])}) "
               f"reports")
    else:
        file, name = files[held_out[0]], paths[held_out[0]].name
        index = {c: i for i, c in enumerate(classes)}
        labels = np.asarray([index[label] for label in file.labels] if file.kind == "labelled" else [0] * len(file))
        if len(file) < 2:
            raise UserError(f"{paths[held_out[0]]} holds {len(file)} {noun}; halving it into validation and test "
                            f"needs at least 2 (give val and test files, or more {noun})")
        choose, report = split_in_halves(labels, seed)
        val, test = _examples(file, classes, choose), _examples(file, classes, report)
        by = "by label " if file.kind == "labelled" else ""
        how = (f"{root.name} has {paths['train'].name} and {name} only: {name}'s {len(file)} {noun} were split "
               f"{by}(seed {seed}) into {len(choose)} validation {noun} that choose and "
               f"{len(report)} test {noun} that report; {paths['train'].name} ({len(train)}) fits")
    return TextSplits(f"text:{root}", _examples(train, classes), val, test, classes, kind, how)


def test_files(path: str) -> dict[Path, str]:
    """The files of `text:PATH` that hold its test texts (resolved), each with how, as
    `load_text_splits` reads them: a file that is split, a folder's test file, or its only held-out
    file, which is halved. {} where PATH is neither a file nor a folder."""
    root = Path(path).expanduser()
    if root.is_file():
        return {root.resolve(): "is the --dataset file, which is split into train, validation and test"}
    if not root.is_dir():
        return {}
    roles = _role_files(root)
    held_out = [role for role in ("val", "test") if role in roles]
    if len(held_out) == 1:
        return {roles[held_out[0]].resolve(): "is the dataset's only held-out file, half of which is the test split"}
    return {roles["test"].resolve(): "is the dataset's test file"}


def load_text_splits(path: str, seed: int = 0) -> TextSplits:
    """`text:PATH`'s three roles: a file split seeded (stratified by label where labelled), or a
    folder's train/val/test files as given (one held-out file halved)."""
    root = Path(path).expanduser()
    if root.is_file():
        return _split_file(root, seed)
    if root.is_dir():
        return _given_splits(root, seed)
    raise UserError(f"text dataset {root} does not exist (use text:FILE.txt|.tsv|.csv, or text:FOLDER holding "
                    f"train.*, val.* and test.*)")
