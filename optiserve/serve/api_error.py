"""The one exception the serving code raises for an answer other than success: a status and a message."""

from __future__ import annotations


class ApiError(Exception):
    """Answer `status` with `message` (and `headers`): HTTP as is, gRPC mapped to its status code."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


class ClientGone(Exception):
    """The client hung up before its answer: nothing is sent, and its queued rows are not run."""
