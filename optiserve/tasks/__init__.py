"""Tasks (`get_task`, `register_task`): what a model's output means to the optimizer's gate and
the server's answers."""

from optiserve.tasks.registry import GateLimits, Task, get_task, list_tasks, register_task
from optiserve.tasks import classification, detection, embedding, segmentation  # noqa: F401  registers the built-in tasks

__all__ = ["GateLimits", "Task", "get_task", "list_tasks", "register_task"]
