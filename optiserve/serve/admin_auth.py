"""Who may change what is served: the repository and traffic endpoints are off (403) unless the
server was given a token file, and then need `Authorization: Bearer <token>`."""

from __future__ import annotations

import hmac
from pathlib import Path

from optiserve.errors import UserError

MIN_TOKEN_CHARS = 16


class AdminAuth:
    def __init__(self, token_file: str | None):
        self._token: bytes | None = None
        if token_file is not None:
            path = Path(token_file)
            try:
                token = path.read_text().strip()
            except OSError as e:
                raise UserError(f"--admin-token-file {path}: cannot read it ({e.strerror})") from None
            if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
                raise UserError(f"--admin-token-file {path}: the token must be one line of at least "
                                f"{MIN_TOKEN_CHARS} characters without spaces (e.g. `openssl rand -hex 32`)")
            self._token = token.encode()

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, authorization: str | None) -> tuple[int, str] | None:
        """None when allowed, else (status, message): 403 when disabled or the token is wrong, 401
        when none was sent. The token is compared in constant time and never echoed."""
        if self._token is None:
            return 403, ("the repository and traffic endpoints are disabled: start the server with "
                         "--admin-token-file FILE to enable them")
        scheme, _, sent = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not sent.strip():
            return 401, "this endpoint needs the header `Authorization: Bearer <token>`"
        if not hmac.compare_digest(sent.strip().encode(), self._token):
            return 403, "wrong admin token"
        return None
