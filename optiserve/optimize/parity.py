"""How a copy of the model is held to the original: a traced or exported copy within a tolerance,
or by its task's own measure where plain differences mislead (a detector's boxes swap places when
they score alike); and how the accuracy-aware fallback ranks layers by the same measure."""

from __future__ import annotations

from optiserve.models import LoadedModel
from optiserve.optimize.outputs import as_arrays
from optiserve.tasks import get_task


def parity(loaded: LoadedModel, atol: float) -> dict:
    """How a traced or exported copy is held to eager: max |Δ| within `atol`, or the task's own
    measure within its limit (a detector's boxes swap places when they score alike)."""
    task = get_task(loaded.task)
    if task.disagreement_name is None:
        return {"atol": atol}
    return {"atol": task.disagreement_limit,
            "difference": lambda a, b: task.disagreement(as_arrays(a)[0], as_arrays(b)[0])}


def sensitivity(loaded: LoadedModel) -> dict:
    """How the accuracy-aware fallback ranks layers: by mean squared output difference from fp32, or
    by the task's own measure against fp32's output where it has one."""
    task = get_task(loaded.task)
    if task.disagreement_name is None:
        return {}
    return {"error": lambda out, reference: task.disagreement(reference, out),
            "error_name": f"{task.disagreement_name} (fp32's)"}


def parity_measure(loaded: LoadedModel) -> str:
    return get_task(loaded.task).disagreement_name or "max |Δ|"
