"""The pruning search: channels removed at several ratios, light to heavy, each recovered by
distillation, its INT8 variants built, every candidate judged by the gate and timed; what is not on
the speed/accuracy frontier leaves the folder with its reason kept in the manifest."""

from __future__ import annotations

import numpy as np
import pytest

from optiserve.artifacts import read_manifest
from optiserve.errors import UserError
from optiserve.machine import CPU_FLAGS_ENV
from optiserve.optimize.frontier import KEPT_RECOMMENDED, drop_off_frontier, mark_frontier
from optiserve.optimize.judge import Timed, recommend
from optiserve.optimize.pipeline import OptimizeConfig, run_optimize

# The search is what these runs are about: its candidates are timed at batch 1 alone, and the bf16 copies
# of the unpruned model (tests/test_cpu_flags.py builds and judges those) are left out where the CPU has bf16.
NO_BF16 = "-avx512_bf16,-amx_bf16"


@pytest.fixture(scope="module")
def searched(small_cnn_checkpoint, tmp_path_factory):
    """Every kind of candidate the search builds: pruned, its ONNX Runtime INT8 and OpenVINO's INT8 (whose
    IR has a companion file that must leave with it when it is dropped). No accuracy-aware fallback: a
    candidate's INT8 that misses the gate (a network left 2% of its channels) stays rejected instead of
    having its layers searched, which no test here reads (tests/test_accuracy_aware.py judges the fallback)."""
    out = tmp_path_factory.mktemp("search") / "small"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CPU_FLAGS_ENV, NO_BF16)
        manifest = run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), int8=True, search="on",
                                               search_ratios=(0.5, 0.98, 0.99), finetune_epochs=1, latency_batch=1,
                                               calib_size=64, accuracy_aware=False, out=str(out), progress=False,
                                               timing_rounds=3))
    return out, manifest


@pytest.fixture(scope="module")
def unrecovered(small_cnn_checkpoint, tmp_path_factory):
    """The same search with no recovery: a pruned candidate keeps the accuracy pruning left it, which
    the gate on the validation images rejects (recovery, checked on those images, would bring it back)."""
    out = tmp_path_factory.mktemp("search") / "unrecovered"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CPU_FLAGS_ENV, NO_BF16)
        manifest = run_optimize(OptimizeConfig("small_cnn", weights=str(small_cnn_checkpoint), search="on",
                                               search_ratios=(0.5, 0.9), finetune_epochs=0, openvino=False,
                                               latency_batch=1, out=str(out), progress=False, timing_rounds=3))
    return out, manifest


def _all_candidates(manifest: dict) -> dict:
    return {**{v["name"]: v for v in manifest["variants"]}, **{d["name"]: d for d in manifest["search"]["dropped"]}}


def test_a_recovered_candidate_passes_and_one_left_as_pruning_left_it_is_rejected(searched, unrecovered):
    candidates = _all_candidates(searched[1])
    assert candidates["pruned50"]["status"] == "accepted"  # a quarter of the multiply-adds, recovered
    assert candidates["pruned50"]["settings"]["macs_after"] < 0.3 * candidates["pruned50"]["settings"]["macs_before"]
    rejected = _all_candidates(unrecovered[1])["pruned50"]
    assert rejected["status"] == "rejected" and rejected["reason"].startswith("top-1 fell")
    assert rejected["settings"]["gate_after_recovery"]["status"] == "rejected"


def test_the_search_stops_at_the_first_ratio_whose_model_fails_the_gate(unrecovered):
    _, manifest = unrecovered
    skipped = {row["name"]: row["reason"] for row in manifest["skipped"]}
    assert skipped["pruned90"].startswith("not tried: pruned50, with fewer channels removed, failed the gate once "
                                          "recovered (top-1 fell")


def test_search_minutes_count_recovery_only_so_a_candidate_s_int8_copies_leave_the_next_share_as_it_was(searched):
    """Each candidate gets an even share of what is left of --search-minutes; what is left shrinks by
    the time a candidate spent recovering and being judged, not by its export and its INT8 copies
    (which --int8, --packed and the engines add), so the variants asked for do not change the later
    candidates' recovery."""
    candidates = _all_candidates(searched[1])
    built = [candidates[name]["settings"]["search"] for name in ("pruned50", "pruned98", "pruned99")
             if name in candidates]
    assert len(built) >= 2 and all(f"{name}-int8" in candidates for name in ("pruned50", "pruned98"))
    left = [s["share_s"] * (3 - i) for i, s in enumerate(built)]  # 3 candidates share what is left evenly
    for i in range(len(built) - 1):
        assert 0 < built[i]["recovering_s"] < built[i]["share_s"]
        assert left[i + 1] == pytest.approx(left[i] - built[i]["recovering_s"], abs=0.5)


def test_only_the_frontier_of_the_search_is_published_and_every_candidate_says_why(searched):
    out, manifest = searched
    n = str(manifest["latency_batch"])
    published = {v["name"]: v for v in manifest["variants"]}
    frontier = manifest["search"]["frontier"]
    assert frontier and set(frontier) <= set(published)
    speeds = [published[name]["latency_ms"][n] for name in frontier]
    tops = [published[name]["validation"]["accuracy"]["top1"] for name in frontier]  # what it is drawn on
    assert speeds == sorted(speeds) and tops == sorted(tops)  # faster on it means less accurate
    for row in manifest["search"]["dropped"]:
        assert "search" in row["settings"] and row["dropped"]
        assert row["dropped"].startswith(("dominated by ", "rejected: "))
        assert row["name"] not in published
    assert manifest["search"]["dropped"]  # candidates as accurate on validation as a faster one leave
    files = {p.name for p in out.iterdir()}
    assert files - {v["file"] for v in manifest["variants"]} - {c for v in manifest["variants"]
                                                               for c in v.get("companions", {})} == {
        "manifest.json", "report.md", "frontier.svg"}
    for row in manifest["search"]["dropped"]:  # the dropped candidates' files are not published
        assert f"model.{row['name']}.onnx" not in files
    for v in manifest["variants"]:
        assert v["file"] in files
        if "search" in v["settings"] and not v["frontier"]["on"]:  # off it, kept only where a recommendation names it
            assert v["frontier"]["why"].endswith(KEPT_RECOMMENDED)
            assert v["name"] in (manifest["recommended"]["latency"], manifest["recommended"]["throughput"])
    recommended = manifest["recommended"]
    assert {recommended["latency"], recommended["throughput"]} <= set(published)
    assert read_manifest(out) == manifest


def test_a_candidate_off_the_frontier_stays_where_the_latency_recommendation_names_it():
    """The frontier is drawn at the throughput batch; packed rows, say, win there and lose at batch 1."""
    def entry(name, top1, search=True):
        return {"name": name, "status": "accepted", "reason": None, "size_bytes": 1,
                "validation": {"accuracy": {"top1": top1}}, "settings": {"search": {}} if search else {}}

    rng = np.random.default_rng(0)
    noise = lambda ms: list(ms * (1 + 0.002 * rng.standard_normal(15)))  # noqa: E731
    medians = {"fp32": (5.0, 80.0), "padded": (1.2, 40.0), "packed": (1.5, 20.0), "slower": (1.6, 30.0)}
    entries = [entry("fp32", 0.99, search=False), entry("padded", 0.95), entry("packed", 0.95), entry("slower", 0.94)]
    for e in entries:
        e["latency_ms"] = dict(zip(("1", "16"), medians[e["name"]]))
    times = {b: {name: noise(ms[i]) for name, ms in medians.items()} for i, b in enumerate(("1", "16"))}
    timed = Timed(dict.fromkeys(medians), dict.fromkeys(times), times)  # apart beyond noise: never run again
    mark_frontier(entries, 16, "classification")
    assert [e["frontier"]["on"] for e in entries] == [True, False, True, False]
    recommended = recommend(entries, timed, 16)
    assert (recommended["latency"], recommended["throughput"]) == ("padded", "packed")
    kept, dropped = drop_off_frontier(entries, keep={recommended["latency"], recommended["throughput"]})
    assert [e["name"] for e in kept] == ["fp32", "padded", "packed"]
    assert [row["name"] for row in dropped] == ["slower"]
    assert kept[1]["frontier"]["why"].startswith("dominated by packed") and \
        kept[1]["frontier"]["why"].endswith(KEPT_RECOMMENDED)
    assert kept[0]["frontier"]["why"] is None  # not the search's: nothing added


def test_the_report_shows_the_frontier_with_every_candidate(searched, unrecovered):
    rejected = (unrecovered[0] / "report.md").read_text().split("## Search", 1)[1]
    assert "dropped: rejected: top-1 fell" in rejected
    out, manifest = searched
    report = (out / "report.md").read_text()
    assert "## Search: speed against accuracy (channels pruned, at 50%, 98%, 99%" in report
    section = report.split("## Search", 1)[1]
    for name in _all_candidates(manifest):
        assert f"| {name} |" in section
    assert "**on the frontier**" in section
    plot = (out / "frontier.svg").read_text()  # the picture beside it: every variant and candidate, a point each
    assert "![speed against accuracy](frontier.svg)" in section and plot.startswith("<svg")
    assert plot.count("<circle") == len(_all_candidates(manifest)) + 3  # and the legend's three
    for name in _all_candidates(manifest):
        assert f"<title>{name} (" in plot
    for name in manifest["search"]["frontier"]:
        assert f">{name}</text>" in plot


def test_by_default_the_command_searches_only_where_the_data_can_judge(tmp_path, monkeypatch, capsys):
    from optiserve.cli import main

    monkeypatch.setenv(CPU_FLAGS_ENV, NO_BF16)
    capsys.readouterr()  # through the CLI's entry point in this process: torch is imported already
    code = main(["optimize", "small_cnn", "--weights", "random", "--dataset", "synthetic", "--no-openvino",
                 "--latency-batch", "1", "--timing-rounds", "3", "--out", str(tmp_path / "a")])
    stderr = capsys.readouterr().err
    assert code == 0, stderr
    assert "search" not in read_manifest(tmp_path / "a") and "pruning search" not in stderr


@pytest.mark.parametrize("options, message", [
    (dict(search="on", prune_channels=0.5), "--prune-channels prunes at the one ratio given; the search tries several"),
    (dict(search="on", search_ratios=(0.7, 0.3)), "--search-ratios must be fractions in \\(0, 1\\), light to heavy"),
    (dict(search="on", search_minutes=0), "--search-minutes must be more than 0"),
])
def test_search_options_that_cannot_work_are_one_line(options, message):
    with pytest.raises(UserError, match=message):
        OptimizeConfig("small_cnn", **options).validate()


def test_an_interrupted_search_resumes_from_the_candidates_it_had_recovered(small_cnn_checkpoint, tmp_path,
                                                                            monkeypatch):
    from optiserve.optimize import recovery
    from optiserve.optimize.search_cache import cache_folder

    monkeypatch.setenv(CPU_FLAGS_ENV, NO_BF16)
    recovered, real = [], recovery.recover

    def interrupted_in_the_second(*args, **kwargs):
        recovered.append(kwargs.get("deadline"))
        if len(recovered) == 2:
            raise KeyboardInterrupt  # Ctrl-C while the second ratio recovers
        return real(*args, **kwargs)

    monkeypatch.setattr(recovery, "recover", interrupted_in_the_second)
    out = tmp_path / "a"
    options = dict(weights=str(small_cnn_checkpoint), search="on", search_ratios=(0.5, 0.7), openvino=False,
                   latency_batch=1, timing_rounds=3, out=str(out), progress=False)
    with pytest.raises(KeyboardInterrupt):
        run_optimize(OptimizeConfig("small_cnn", **options))
    assert not out.exists() and len(list(cache_folder(out).glob("*.json"))) == 1  # the first one, recovered

    recovered.clear()
    manifest = run_optimize(OptimizeConfig("small_cnn", resume=True, **options))
    assert len(recovered) == 1  # only the ratio the interruption cut short recovers again
    candidates = _all_candidates(manifest)
    assert {"pruned50", "pruned70"} <= set(candidates)
    assert candidates["pruned50"]["settings"]["recovery"]["epochs"] == 5
    assert any(note.startswith("pruned50: ") for note in manifest["notes"])
    assert not cache_folder(out).exists()  # published: nothing is kept any more


@pytest.mark.parametrize("damaged", ["{not json", "[]", '{"recovery": null}', '{"gate_after_recovery": {"status": 1}}'])
def test_a_kept_candidate_whose_settings_were_damaged_is_built_again_not_a_failed_pass(tmp_path, damaged):
    from optiserve.optimize.search_cache import SearchCache

    cache = SearchCache(tmp_path / "a", {"model": "small_cnn"}, resume=True)
    onnx = tmp_path / "candidate.onnx"
    onnx.write_bytes(b"an onnx file")
    settings = {"gate_after_recovery": {"status": "accepted", "reason": None}, "recovery": None}
    cache.keep(0.5, onnx, settings)
    assert cache.take(0.5, tmp_path / "taken.onnx") == settings
    assert (tmp_path / "taken.onnx").read_bytes() == b"an onnx file"
    (kept,) = cache.folder.glob("*.json")
    kept.write_text(damaged)  # edited by hand, or cut short
    assert cache.take(0.5, tmp_path / "again.onnx") is None and not (tmp_path / "again.onnx").exists()


def test_a_candidate_whose_share_of_the_time_ran_out_is_described_by_its_steps_not_its_planned_epochs():
    from optiserve.optimize.recovery import recovery_line, validation_change

    report = {"epochs": 5, "steps": 25, "rounds": [5], "stopped_at_deadline": True, "undone_round": False,
              "good_enough": True}
    settings = {"validation_before_recovery": {"cosine_mean": 0.555}, "validation_after_recovery": {"cosine_mean": 0.8},
                "recovery": report}
    assert recovery_line(report, "texts") == ("recovered for 25 steps of the 5 epochs planned (its share of the time "
                                              "ran out): the validation texts pass the gate")
    assert validation_change(settings, "dropping", percent=False).endswith("0.8000 after 25 steps of recovery")
    finished = {**report, "stopped_at_deadline": False}
    assert recovery_line(finished, "texts") == "recovered for 5 epochs: the validation texts pass the gate"
    assert validation_change({**settings, "recovery": finished}, "dropping", percent=False) == \
        "; validation cosine_mean 0.5550 right after dropping, 0.8000 after 5 epochs of recovery"


def test_a_candidate_whose_share_is_shorter_than_one_recovery_epoch_is_not_tried():
    from optiserve.optimize.search import too_short

    assert too_short(0.0, None, 10) == "not tried: --search-minutes 10 ran out before it"
    assert too_short(30.0, None, 10) == ""  # nothing recovered before it: nothing to go by
    assert too_short(30.0, 12.0, 10) == ""  # two epochs and more fit
    assert too_short(9.4, 12.0, 10) == ("not tried: its share of --search-minutes 10 (9.4 s) is less than one "
                                        "recovery epoch took on the candidate before it (12.0 s)")
