"""Tasks (`get_task`, `register_task`): what a model's output means to the optimizer's gate and
the server's answers."""

from optiserve.tasks.registry import (GateLimits, GateMinimum, Parameter, Task, gate_minimums, get_task, list_tasks,
                                      register_reading, register_task, task_of, task_parameters,
                                      unmatched_answers)
from optiserve.tasks import classification, detection, embedding, segmentation  # noqa: F401  registers the built-in tasks
from optiserve.tasks import multi_label  # noqa: F401  registers classification's reading of multi-label scores
from optiserve.tasks import text_classification, text_embedding  # noqa: F401  the text tasks

__all__ = ["GateLimits", "GateMinimum", "Parameter", "Task", "gate_minimums", "get_task", "list_tasks",
           "register_reading", "register_task", "task_of", "task_parameters", "unmatched_answers"]
