"""Text datasets (`text:PATH`): a user's texts read and split into the three roles — train fits,
validation chooses, test only reports — on real data where it can be: gensim's test corpora, the
Pang & Lee movie-review polarity sentences (fastText labels, written in cp1252) and the Lee news
documents with their human similarity ratings."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from optiserve.data import load_dataset
from optiserve.data.partition import SPLIT_FRACTIONS
from optiserve.data.text import TextSplits, load_text_splits, read_text_file
from optiserve.errors import UserError
from optiserve.input_spec import InputSpec


@pytest.fixture(scope="module")
def gensim_data() -> Path:
    """The folder of corpora gensim's wheel carries for its own tests."""
    pytest.importorskip("gensim", reason="gensim's bundled corpora are the real texts these tests read "
                                         "(pip install -e '.[dev]')")
    from gensim.test.utils import datapath

    return Path(datapath("pang_lee_polarity.cor")).parent


@pytest.fixture
def polarity(gensim_data, tmp_path) -> Path:
    """The 200 polarity sentences converted to UTF-8, as `iconv -f cp1252 -t utf-8` would."""
    path = tmp_path / "polarity.txt"
    path.write_text((gensim_data / "pang_lee_polarity.cor").read_bytes().decode("cp1252"), encoding="utf-8")
    return path


def _lee_pairs(gensim_data) -> list[tuple[str, str, float]]:
    """The 1,225 pairs of Lee's 50 documents with their human similarity (the upper triangle of the
    ratings matrix, read as gensim's own test_lee.py does: latin-1 documents, np.loadtxt ratings)."""
    docs = [line.strip() for line in (gensim_data / "lee.cor").read_bytes().decode("latin-1").splitlines()]
    ratings = np.loadtxt(gensim_data / "similarities0-1.txt")
    i, j = np.triu_indices(len(docs), 1)
    return [(docs[a], docs[b], float(ratings[a, b])) for a, b in zip(i, j)]


def _write_table(path: Path, header: list[str], rows, delimiter: str) -> Path:
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _roles(splits: TextSplits):
    return splits.train, splits.val, splits.test


# --- one file: read, then split seeded ---------------------------------------------------------


def test_a_cp1252_file_is_refused_in_one_line_that_names_the_conversion(gensim_data, tmp_path):
    raw = tmp_path / "polarity.txt"
    raw.write_bytes((gensim_data / "pang_lee_polarity.cor").read_bytes())  # as-is: cp1252
    with pytest.raises(UserError) as e:
        load_text_splits(str(raw))
    message = str(e.value)
    assert "\n" not in message and "not UTF-8" in message and "iconv -f cp1252 -t utf-8" in message
    assert "line 27" in message  # where its first such byte is


def test_the_polarity_sentences_in_utf8_read_as_labelled_texts_of_both_classes(polarity):
    file = read_text_file(polarity)
    assert file.kind == "labelled" and len(file.texts) == 200
    assert sorted(set(file.labels)) == ["neg", "pos"] and file.labels.count("pos") == 100
    assert file.texts[0] == "simplistic , silly and tedious ."  # the prefix and its space taken off
    assert not any(t.startswith("__label__") for t in file.texts)
    assert any("—" in t for t in file.texts)  # cp1252's 0x97, an em dash, read as one


def test_a_file_is_split_into_disjoint_stratified_roles_that_cover_every_text_once(polarity):
    splits = load_text_splits(str(polarity), seed=0)
    assert splits.kind == "labelled" and splits.classes == ["neg", "pos"] and splits.name == f"text:{polarity}"
    roles = _roles(splits)
    texts = [t for role in roles for t in role.texts]
    assert sorted(texts) == sorted(read_text_file(polarity).texts)  # every text once (the 200 are distinct)
    assert [len(r) for r in roles] == [139, 21, 40]  # SPLIT_FRACTIONS, as an image folder splits
    assert [round(len(r) / 200, 1) for r in roles] == list(SPLIT_FRACTIONS)
    label_of = dict(zip(read_text_file(polarity).texts, read_text_file(polarity).labels))
    for role in roles:
        assert set(role.labels) == {0, 1}  # both classes in each role
        assert [splits.classes[i] for i in role.labels] == [label_of[t] for t in role.texts]
        assert abs(np.mean(role.labels) - 0.5) <= 0.5 / len(role) + 1e-9  # within one text of half each
    assert "200 texts" in splits.how and "seed 0" in splits.how and "by label" in splits.how


def test_the_split_is_the_same_for_a_seed_and_another_for_another_seed(polarity):
    first, again, other = (load_text_splits(str(polarity), seed=s) for s in (0, 0, 1))
    assert [r.texts for r in _roles(first)] == [r.texts for r in _roles(again)]
    assert first.test.texts != other.test.texts
    assert "seed 1" in other.how


def test_lee_documents_paired_with_their_human_ratings_read_as_1225_scored_pairs(gensim_data, tmp_path):
    pairs = _lee_pairs(gensim_data)
    path = _write_table(tmp_path / "lee.tsv", ["text1", "text2", "score"], pairs, "\t")
    file = read_text_file(path)
    assert file.kind == "pairs" and len(file.texts) == len(file.second) == 1225
    assert file.scores.dtype == np.float64 and file.scores.shape == (1225,)
    assert np.array_equal(file.scores, [s for _, _, s in pairs])
    assert list(zip(file.texts, file.second)) == [(a, b) for a, b, _ in pairs]  # quotes in the news survive
    splits = load_text_splits(str(path), seed=0)
    assert splits.kind == "pairs" and splits.classes == [] and [len(r) for r in _roles(splits)] == [857, 122, 246]
    score_of = {(a, b): s for a, b, s in pairs}
    for role in _roles(splits):  # a pair keeps its own score wherever it lands
        assert [score_of[p] for p in zip(role.texts, role.second)] == role.scores.tolist()
        assert role.labels is None


def test_a_tsv_and_a_csv_of_the_same_rows_read_equal(gensim_data, tmp_path):
    pairs = _lee_pairs(gensim_data)[:60]  # news text: commas and double quotes inside the fields
    tsv = read_text_file(_write_table(tmp_path / "lee.tsv", ["text1", "text2", "score"], pairs, "\t"))
    csv_ = read_text_file(_write_table(tmp_path / "lee.csv", ["text1", "text2", "score"], pairs, ","))
    assert (tsv.texts, tsv.second, tsv.kind) == (csv_.texts, csv_.second, csv_.kind)
    assert np.array_equal(tsv.scores, csv_.scores)


def test_unlabelled_lines_and_a_text_column_read_as_plain_texts(gensim_data, tmp_path):
    docs = [a for a, _, _ in _lee_pairs(gensim_data)[:49]]
    lines = tmp_path / "lee.txt"
    lines.write_text("\n\n".join(docs) + "\n\n", encoding="utf-8")  # blank lines are skipped
    table = _write_table(tmp_path / "lee.csv", ["id", "text"], enumerate(docs), ",")  # extra column ignored
    for path in (lines, table):
        file = read_text_file(path)
        assert file.kind == "texts" and file.texts == docs and file.labels is None
    splits = load_text_splits(str(lines), seed=0)
    assert splits.kind == "texts" and [len(r) for r in _roles(splits)] == [34, 4, 11]


def test_a_byte_order_mark_is_tolerated(tmp_path):
    path = tmp_path / "reviews.csv"
    path.write_bytes("text,label\nfine film,pos\nawful,neg\n".encode("utf-8-sig"))
    file = read_text_file(path)
    assert file.kind == "labelled" and file.texts == ["fine film", "awful"] and file.labels == ["pos", "neg"]


def test_our_tsv_and_csv_reading_agrees_with_pandas(tmp_path):
    """An independent reader on the hard cases: quoted fields holding the delimiter, the other
    delimiter, doubled quotes and line breaks."""
    pd = pytest.importorskip("pandas", reason="pandas.read_csv is the independent reference")
    rows = {
        ",": 'text,label,note\n'
             '"a, b and c",pos,x\n'
             '"she said ""no""",neg,y\n'
             'tab\there,pos,z\n'
             '"two\nlines, one text",neg,w\n'
             '"CR LF\r\ninside",pos,v\n',
        "\t": 'text\tlabel\tnote\n'
              '"a\tb"\tpos\tx\n'
              'commas, stay, plain\tneg\ty\n'
              '"quoted ""word"""\tpos\tz\n'
              '"line\nbreak"\tneg\tw\n',
    }
    for delimiter, content in rows.items():
        path = tmp_path / ("rows.csv" if delimiter == "," else "rows.tsv")
        path.write_bytes(content.encode("utf-8"))
        ours = read_text_file(path)
        theirs = pd.read_csv(path, sep=delimiter, dtype=str, keep_default_na=False)
        assert ours.texts == theirs["text"].tolist() and ours.labels == theirs["label"].tolist()
    assert read_text_file(tmp_path / "rows.csv").texts == [
        "a, b and c", 'she said "no"', "tab\there", "two\nlines, one text", "CR LF\r\ninside"]
    assert read_text_file(tmp_path / "rows.tsv").texts == ["a\tb", "commas, stay, plain", 'quoted "word"',
                                                           "line\nbreak"]


# --- a folder of role files -----------------------------------------------------------------------


def _role_folder(polarity: Path, folder: Path, roles: dict[str, slice]) -> dict[str, list[str]]:
    """Write slices of the polarity lines (neg then pos, 100 each) as ROLE.txt files; their lines."""
    lines = [line for line in polarity.read_text(encoding="utf-8").splitlines() if line.strip()]
    folder.mkdir()
    written = {}
    for role, part in roles.items():
        written[role] = lines[part] + lines[100:][part]  # the same slice of both classes
        (folder / f"{role}.txt").write_text("\n".join(written[role]) + "\n", encoding="utf-8")
    return written


def test_a_folder_with_train_val_and_test_files_uses_them_as_given(polarity, tmp_path):
    written = _role_folder(polarity, tmp_path / "reviews",
                           {"train": slice(0, 60), "val": slice(60, 80), "test": slice(80, 100)})
    splits = load_text_splits(str(tmp_path / "reviews"))
    assert [len(r) for r in _roles(splits)] == [120, 40, 40] and splits.classes == ["neg", "pos"]
    for role, examples in zip(("train", "val", "test"), _roles(splits)):
        assert examples.texts == [line.split(" ", 1)[1].strip() for line in written[role]]  # in the file's order
    assert "as given" in splits.how and "val.txt" in splits.how and "test.txt" in splits.how


def test_a_folder_with_only_train_and_val_halves_val_by_label_into_choosing_and_reporting(polarity, tmp_path):
    written = _role_folder(polarity, tmp_path / "reviews", {"train": slice(0, 60), "val": slice(60, 100)})
    splits = load_text_splits(str(tmp_path / "reviews"), seed=0)
    val_texts = [line.split(" ", 1)[1].strip() for line in written["val"]]
    assert len(splits.train) == 120 and len(splits.val) == len(splits.test) == 40
    assert sorted(splits.val.texts + splits.test.texts) == sorted(val_texts)  # disjoint, all of val.txt
    assert splits.val.labels.count(0) == splits.test.labels.count(0) == 20  # halved by label
    assert "val.txt only" in splits.how and "validation" in splits.how and "test" in splits.how
    assert "seed 0" in splits.how
    assert load_text_splits(str(tmp_path / "reviews"), seed=1).val.texts != splits.val.texts


def test_unlabelled_training_texts_fit_beside_scored_pairs_that_choose_and_report(gensim_data, tmp_path):
    pairs = _lee_pairs(gensim_data)[:60]
    folder = tmp_path / "lee"
    folder.mkdir()
    (folder / "train.tsv").write_text("text\n" + "".join(f"{a}\n" for a, _, _ in pairs[:30]), encoding="utf-8")
    _write_table(folder / "val.tsv", ["text1", "text2", "score"], pairs[30:45], "\t")
    _write_table(folder / "test.tsv", ["text1", "text2", "score"], pairs[45:], "\t")
    splits = load_text_splits(str(folder))
    assert splits.kind == "pairs" and splits.train.scores is None and len(splits.train) == 30
    assert list(splits.val.scores) == [score for _, _, score in pairs[30:45]]
    assert "train.tsv (30 texts) fits" in splits.how
    (folder / "train.tsv").write_text("text\tlabel\na\tpos\n", encoding="utf-8")  # labelled texts do not fit pairs
    with pytest.raises(UserError, match="only scored pairs may be held out beside unlabelled training texts"):
        load_text_splits(str(folder))
    # the other way round: plain texts cannot be scored as pairs
    _write_table(folder / "train.tsv", ["text1", "text2", "score"], pairs[:30], "\t")
    for role, rows in (("val", pairs[30:45]), ("test", pairs[45:])):
        (folder / f"{role}.tsv").write_text("text\n" + "".join(f"{a}\n" for a, _, _ in rows), encoding="utf-8")
    with pytest.raises(UserError, match="(val|test).tsv holds texts but train.tsv holds pairs"):
        load_text_splits(str(folder))


# --- what is refused, in one line that names the fix ----------------------------------------------


MALFORMED = {
    "mixed fastText labels": ("mixed.txt", "__label__pos good\n__label__neg bad\nno label here\n",
                              ["line 3", "__label__", "every line"]),
    "two labels on a line": ("two.txt", "__label__pos __label__neg both\n", ["line 1", "one label"]),
    "a label with no text": ("bare.txt", "__label__pos\n", ["line 1", "__label__NAME TEXT"]),
    "missing columns": ("cols.tsv", "sentence\tsentiment\nnice\tpos\n", ["'sentence'", "`text`", "`text1`"]),
    "a score that is no number": ("pairs.csv", "text1,text2,score\na,b,0.5\nc,d,high\n",
                                  ["line 3", "'high'", "number"]),
    "an infinite score": ("inf.csv", "text1,text2,score\na,b,inf\n", ["line 2", "finite"]),
    "an empty file": ("empty.txt", "", ["empty", "one a line"]),
    "blank lines only": ("blank.txt", "\n  \n\n", ["empty"]),
    "a header and no rows": ("header.csv", "text,label\n", ["no examples", "one example a row"]),
    "a short row": ("short.csv", "text,label\na,pos\nb\n", ["line 3", "1 field but the header has 2", "quote"]),
    "an empty text": ("gap.tsv", "text\tlabel\n\tpos\n", ["line 2", "empty 'text'"]),
    "an unknown format": ("texts.json", '["a"]', [".txt", ".tsv", ".csv"]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_input_is_one_line_that_names_the_fix(case, tmp_path):
    name, content, words = MALFORMED[case]
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(UserError) as e:
        load_text_splits(str(tmp_path / name))
    message = str(e.value)
    assert "\n" not in message, message
    assert all(w in message for w in words), message


def test_too_few_texts_of_a_label_to_split_is_refused(tmp_path):
    path = tmp_path / "few.tsv"
    path.write_text("text\tlabel\n" + "".join(f"good {i}\tpos\n" for i in range(20)) + "bad\tneg\n", encoding="utf-8")
    with pytest.raises(UserError, match="label 'neg' has 1 texts; every label needs at least 5"):
        load_text_splits(str(path))
    # five of each of three labels: the validation texts cannot hold all three
    path.write_text("text\tlabel\n" + "".join(f"text {i}\t{'abc'[i % 3]}\n" for i in range(15)), encoding="utf-8")
    with pytest.raises(UserError, match="15 texts with 3 labels cannot give every label a place in train, validation "
                                        "and test: give each label at least 10 texts"):
        load_text_splits(str(path))


@pytest.mark.parametrize("files, words", [
    ({"train.txt": "a\nb\n"}, ["train.txt", "val.*"]),
    ({"train.txt": "a\nb\n", "val.csv": "text\nc\n"}, ["different formats", "write them all as .txt"]),
    ({"train.txt": "a\n", "train.tsv": "text\na\n", "val.txt": "b\n"}, ["keep one train file"]),
    ({"train.tsv": "text\tlabel\na\tpos\n", "val.tsv": "text\tlabel\nb\tPOS\n"}, ["POS", "same names"]),
    ({"train.tsv": "text\tlabel\na\tpos\n", "val.tsv": "text\nb\n"}, ["holds texts", "same columns"]),
])
def test_a_folder_whose_files_do_not_make_the_roles_is_refused(files, words, tmp_path):
    for name, content in files.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(UserError) as e:
        load_text_splits(str(tmp_path))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_a_path_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(UserError, match="does not exist.*text:FILE.txt"):
        load_text_splits(str(tmp_path / "nothing.tsv"))


# --- where text datasets plug in ------------------------------------------------------------------


def test_an_image_models_dataset_refuses_text_in_one_clear_line(tmp_path):
    with pytest.raises(UserError) as e:
        load_dataset(f"text:{tmp_path}/reviews.tsv", InputSpec((3, 32, 32), (0.5,) * 3, (0.5,) * 3), 2)
    assert "text:PATH is for text models" in str(e.value) and "takes images" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_reader_is_exported_from_the_data_package():
    import optiserve.data

    assert optiserve.data.load_text_splits is load_text_splits and "load_text_splits" in optiserve.data.__all__
