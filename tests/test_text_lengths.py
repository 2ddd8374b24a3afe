"""A text model timed at set sequence lengths: a small BERT classifier (max length 64, its WordPiece
tokenizer trained here on the polarity sentences) optimized with onnx-fp32 and onnx-int8; every
variant has a median and a speedup with its interval at each length up to the model's max, the
engine really receives rows of exactly that many real tokens, lengths past the max are skipped by
default and refused when asked for, and the recommendation says at which lengths it holds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import polarity_file, run_cli_here, small_bert_classifier
from optiserve.optimize.lengths import describe_lengths, holds_for
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize
from optiserve.optimize.report import recommendation_line

ort = pytest.importorskip("onnxruntime")

MAX_LENGTH = 64
BATCH = 4
ROUNDS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(the model folder, the polarity file): a seeded, untrained BERT whose position table holds 64 tokens."""
    from optiserve.data.text import load_text_splits

    work = tmp_path_factory.mktemp("text-lengths")
    data = polarity_file(work)
    folder = work / "model"
    small_bert_classifier(folder, load_text_splits(str(data)).train.texts, ["neg", "pos"],
                          MAX_LENGTH).eval().save_pretrained(str(folder), safe_serialization=True)
    return folder, data


@pytest.fixture(scope="module")
def timed(model, tmp_path_factory):
    """(the manifest, what onnxruntime was fed): optimized at the default lengths, every engine call
    observed (and passed on unchanged) on its way into onnxruntime."""
    folder, data = model
    fed: list[dict[str, np.ndarray]] = []
    real_run = ort.InferenceSession.run

    def observed(self, output_names, feeds, *args, **kwargs):
        fed.append({name: np.array(x) for name, x in feeds.items()})
        return real_run(self, output_names, feeds, *args, **kwargs)

    out = tmp_path_factory.mktemp("lengths-artifact") / "artifact"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ort.InferenceSession, "run", observed)
        # every variant accepted (the weights are untrained): two to compare at every length
        run_optimize(OptimizeConfig(str(folder), dataset=f"text:{data}", int8=True, openvino=False,
                                    ort_transformer=False, latency_batch=BATCH, timing_rounds=ROUNDS, calib_size=32,
                                    max_accuracy_drop=100.0, progress=False, out=str(out)))
    return json.loads((out / "manifest.json").read_text()), fed, out


def test_every_variant_is_timed_at_each_length_up_to_the_max(timed):
    manifest, _, _ = timed
    lengths = manifest["seq_lengths"]
    assert lengths["timed"] == [16, 64] and lengths["batch"] == BATCH
    assert lengths["skipped"] == [{"tokens": 256, "reason": f"above the model's max length of {MAX_LENGTH} tokens"}]
    assert {v["name"] for v in manifest["variants"]} == {"onnx-fp32", "onnx-int8"}
    for v in manifest["variants"]:
        assert set(v["latency_by_length"]) == {"16", "64"}
        for at in v["latency_by_length"].values():
            low, high = at["speedup_ci95"]
            assert at["p50_ms"] > 0 and at["rounds"] >= ROUNDS and low <= at["speedup"] <= high
    base = next(v for v in manifest["variants"] if v["name"] == "onnx-fp32")
    assert all(at["speedup"] == 1.0 for at in base["latency_by_length"].values())
    # the headline columns are still the validation texts at their own lengths, and say how long those were
    assert set(manifest["seq_lengths"]["headline_tokens"]) == {"1", str(BATCH)}
    assert all(set(v["latency_ms"]) == {"1", str(BATCH)} for v in manifest["variants"])


def test_the_engine_is_fed_rows_of_exactly_the_length_of_validation_text(timed, model):
    from tokenizers import Tokenizer

    from optiserve.data.text import load_text_splits

    manifest, fed, _ = timed
    folder, data = model
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    first = tokenizer.encode(load_text_splits(str(data)).val.texts[0]).ids  # the rows are the validation role's
    for length in manifest["seq_lengths"]["timed"]:
        # (the runtime's own measure of a run's cost feeds token id 0 throughout: not a timed round)
        at = [f for f in fed if f["input_ids"].shape == (BATCH, length) and f["attention_mask"].all()
              and f["input_ids"].any()]
        assert len(at) >= ROUNDS * len(manifest["variants"])  # warm-up and every round, for each variant
        ids = at[0]["input_ids"]
        assert ids[0, :min(len(first), length)].tolist() == first[:length]
        assert not (ids == tokenizer.token_to_id("[PAD]")).any()
        assert len({row.tobytes() for row in ids}) == BATCH  # each row its own stretch of the texts
    assert max(f["input_ids"].shape[1] for f in fed) <= MAX_LENGTH


def test_the_recommendation_says_at_which_lengths_it_holds(timed):
    manifest, _, out = timed
    rec = manifest["recommended"]
    by_length = rec["by_length"]
    assert by_length["variant"] == rec["throughput"] and by_length["batch"] == BATCH
    assert by_length["lengths"] == [16, 64]
    elsewhere = [n for ns in by_length["faster_elsewhere"].values() for n in ns]
    assert sorted(by_length["holds_for_lengths"] + elsewhere) == [16, 64]
    assert rec["throughput"] not in by_length["faster_elsewhere"]
    line = recommendation_line(manifest)
    assert describe_lengths(by_length) in line and "16" in line and "64 tokens" in line
    report = (out / "report.md").read_text()
    assert "## Latency by sequence length (batch 4)" in report and "Not timed at 256 tokens" in report
    assert describe_lengths(by_length) in report


def test_a_variant_faster_beyond_noise_at_some_lengths_is_named_with_them():
    """The rule on times taken in interleaved rounds: b clearly faster at 256 tokens, a at 16, the two
    within the 2% the rule asks for at 64 (a tie, which holds; no re-timing asked)."""
    rng = np.random.default_rng(0)
    noise = lambda ms: list(ms * (1 + 0.002 * rng.standard_normal(15)))  # noqa: E731
    times = {"16": {"a": noise(1.0), "b": noise(1.5)}, "64": {"a": noise(2.0), "b": noise(1.98)},
             "256": {"a": noise(9.0), "b": noise(6.0)}}
    sessions, batches = {"a": None, "b": None}, dict.fromkeys(times)  # never run: no re-timing
    verdict = holds_for("a", ["a", "b"], sessions, batches, times, {"a": 2, "b": 1}, batch=8, retime_rounds=0)
    assert verdict["holds_for_lengths"] == [16, 64] and verdict["faster_elsewhere"] == {"b": [256]}
    assert verdict["evidence"]["64"]["tie_within_noise"] and not verdict["evidence"]["256"]["tie_within_noise"]
    said = describe_lengths(verdict)
    assert said.startswith("at batch 8, a holds at 16, 64 tokens (a tie within noise with b at 64 tokens); b is "
                           "faster at 256 tokens (1.5")


@pytest.mark.parametrize("given, says", [
    ("16,x", "--seq-lengths: expected positive numbers of tokens separated by commas, e.g. 16,64,256; got '16,x'"),
    ("0,16", "--seq-lengths: expected positive numbers of tokens"),
    ("16,300", "--seq-lengths 16,300: 300 is above the model's max length of 64 tokens; give lengths up to 64"),
])
def test_bad_seq_lengths_are_one_line(model, tmp_path, given, says):
    folder, data = model
    r = run_cli_here("optimize", str(folder), "--dataset", f"text:{data}", "--no-openvino", "--seq-lengths", given,
                     "--out", str(tmp_path / "out"), "--no-progress")
    assert r.returncode != 0 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_seq_lengths_for_an_image_model_is_one_line(tmp_path):
    r = run_cli_here("optimize", "small_cnn", "--weights", "random", "--dataset", "synthetic", "--no-openvino",
                     "--seq-lengths", "16", "--out", str(tmp_path / "out"), "--no-progress")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--seq-lengths times a text model at set numbers of tokens; small_cnn takes images" in r.stderr
