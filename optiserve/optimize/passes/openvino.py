"""OpenVINO variants: the IR at f32 and bf16 inference precision and, with --int8, two INT8
candidates (the QDQ file read by OpenVINO, NNCF's own quantization), settled after judging."""

from __future__ import annotations

from pathlib import Path

from optiserve.optimize.attempts import INT8_PREPARATION, Attempts
from optiserve.optimize.architecture import QuantRecipe
from optiserve.optimize.config import OptimizeConfig
from optiserve.optimize.export_openvino import export_openvino, quantize_openvino_nncf
from optiserve.optimize.judge import Timed
from optiserve.optimize.passes.registry import BOTH, Pass, Run, Variant, register_pass
from optiserve.runtime.openvino_backend import bf16_unavailable


def _build_openvino(run: Run) -> None:
    _openvino_variants(run.stage, run.variants, run.attempts, run.cfg, run.batches, run.recipe,
                       run.loaded.input.shape, run.int8_source, run.conversion)


def openvino_float_variants(stage: Path, variants: list[Variant], attempts: Attempts,
                            chw: tuple[int, int, int] | None) -> None:
    """openvino-fp32 and, where the CPU has bf16, openvino-bf16: one IR of model.onnx (compiled for
    inputs of `chw`; None: its own shapes, a text model's dynamic ones), the precision set at load."""
    title = "OpenVINO IR (fp32 weights; f32 and bf16 inference)"
    if why := attempts.missing("onnx-fp32"):
        attempts.skip(title, why, "openvino-fp32", "openvino-bf16")
        return
    with attempts.attempt(title, "openvino-fp32", "openvino-bf16"):
        ov = export_openvino(stage / "model.onnx", stage / "model.openvino.xml", chw)
        variants.append(Variant("openvino-fp32", "model.openvino.xml", "openvino", "fp32",
                                {**ov, "inference_precision": "f32"}))
        if why := bf16_unavailable():
            attempts.cannot(why, "openvino-bf16")
        else:
            variants.append(Variant("openvino-bf16", "model.openvino.xml", "openvino", "bf16",
                                    {**ov, "inference_precision": "bf16"}))


NNCF_SUFFIX = "-nncf"  # NNCF's INT8 of a variant, validated beside the QDQ flow's; the better one keeps the name
OPENVINO_INT8_CANDIDATE = "openvino-int8" + NNCF_SUFFIX


def _openvino_variants(stage: Path, variants: list[Variant], attempts: Attempts, cfg: OptimizeConfig,
                       batches: list, recipe: QuantRecipe | None, chw: tuple[int, int, int],
                       int8_source: str = "model.onnx", conversion: dict | None = None) -> None:
    """openvino-fp32 and, where the CPU has bf16, openvino-bf16 (one IR, the precision set at load),
    compiled for inputs of `chw`;
    with --int8, two openvino-int8 candidates: the ONNX Runtime QDQ file read by OpenVINO, and NNCF's
    own post-training quantization on the same calibration images (see `pick_openvino_int8_flows`)."""
    openvino_float_variants(stage, variants, attempts, chw)
    if not cfg.int8:
        return
    title = "OpenVINO IR of the INT8 QDQ model -> openvino-int8"
    if why := attempts.missing("onnx-fp32", "onnx-int8"):
        attempts.skip(title, why, "openvino-int8 (qdq flow)")
    else:
        with attempts.attempt(title, "openvino-int8 (qdq flow)"):
            q = next(v for v in variants if v.name == "onnx-int8").settings
            ov = export_openvino(stage / "model.int8.onnx", stage / "model.int8.openvino.xml", chw)
            variants.append(Variant("openvino-int8", "model.int8.openvino.xml", "openvino", "int8",
                                    {**q, **ov, "inference_precision": "f32",
                                     "flow": "qdq", "flow_description": "the ONNX Runtime QDQ file (same "
                                                                        "calibration) read by OpenVINO"}))
    title = "OpenVINO INT8 with NNCF post-training quantization (same calibration images)"
    if why := attempts.missing("onnx-fp32", INT8_PREPARATION):
        attempts.skip(title, why, "openvino-int8 (nncf flow)")
        return
    with attempts.attempt(title, "openvino-int8 (nncf flow)"):
        settings = quantize_openvino_nncf(stage / int8_source, stage / "model.int8.nncf.openvino.xml", batches,
                                          recipe.nncf_model_type)
        variants.append(Variant(OPENVINO_INT8_CANDIDATE, "model.int8.nncf.openvino.xml", "openvino", "int8",
                                {**settings, **recipe.settings(), **(conversion or {}), "inference_precision": "f32",
                                 "flow": "nncf"}))


def pick_openvino_int8_flows(entries: list[dict], n: int, timed: Timed) -> tuple[list[dict], list[str]]:
    """For each OpenVINO INT8 variant built by both flows (`NAME` from the QDQ file, `NAME-nncf` by
    NNCF; openvino-int8, and the pruned ones), keep the flow that passes the gate and is faster at
    batch n (the QDQ one when neither passes), published as NAME; the other's files are left out of
    the folder with everything else no entry names."""
    notes = []
    for nncf_name in [e["name"] for e in entries if e["name"].endswith(NNCF_SUFFIX)]:
        entries, note = _pick_flow(entries, n, timed, nncf_name[: -len(NNCF_SUFFIX)], nncf_name)
        notes += note
    return entries, notes


def _pick_flow(entries: list[dict], n: int, timed: Timed, name: str, nncf_name: str) -> tuple[list[dict], list[str]]:
    by_name = {e["name"]: e for e in entries}
    if name not in by_name:  # the QDQ one did not run
        by_name[nncf_name]["name"] = name
        timed.rename(nncf_name, name)
        return entries, [f"{name}: the nncf flow's, the only one OpenVINO runs"]
    qdq, nncf_ = by_name[name], by_name[nncf_name]
    passing = [e for e in (qdq, nncf_) if e["status"] == "accepted"]
    winner = min(passing, key=lambda e: e["latency_ms"][str(n)]) if passing else qdq
    loser = nncf_ if winner is qdq else qdq
    comparison = {e["settings"]["flow"]: {"status": e["status"], "validation": e["validation"],
                                          "latency_ms": e["latency_ms"]} for e in (qdq, nncf_)}
    winner["settings"] = {**winner["settings"], "flow_comparison": comparison}
    timed.drop(loser["name"])
    if winner is nncf_:
        timed.rename(nncf_name, name)
    winner["name"] = name
    kept = [winner if e is qdq else e for e in entries if e is not nncf_]
    note = (f"{name}: {winner['settings']['flow']} flow kept ({winner['status']}, "
            f"{winner['latency_ms'][str(n)]:.2f} ms at batch {n}) over {loser['settings']['flow']} "
            f"({loser['status']}, {loser['latency_ms'][str(n)]:.2f} ms)")
    return kept, [note]


register_pass(Pass("openvino", BOTH, _build_openvino, asked=lambda cfg: cfg.openvino and cfg.onnx,
                   steps=lambda cfg: 1 + 2 * cfg.int8, settle=pick_openvino_int8_flows))
