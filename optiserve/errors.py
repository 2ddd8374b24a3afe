"""The one exception type the CLI turns into a single readable line instead of a traceback, and
the one-line forms of any exception that messages and failure rows quote."""

import re

ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")  # terminal colour and style codes some libraries put in messages


class UserError(Exception):
    """Bad input from the user (an option, a path, a file): the message says what is wrong and how to fix it."""


def first_line(e: BaseException, with_type: bool = False, limit: int | None = None) -> str:
    """The first line of an exception's message, cut at `limit` characters (what a one-line error
    quotes of a library's long message); prefixed with the exception's type when `with_type`; the
    type's name alone when the message is empty. Terminal colour codes are taken out."""
    text = ANSI_ESCAPE.sub("", str(e)).strip()
    line = text.splitlines()[0][:limit] if text else ""
    if not line:
        return type(e).__name__
    return f"{type(e).__name__}: {line}" if with_type else line


def root_cause(e: BaseException) -> BaseException:
    """The innermost exception with a message in the chain `e` was raised from (its `__cause__`,
    else its unsuppressed `__context__`), as Python's traceback would print it last: a library's
    wrapper (an exporter's "step 1/3 failed" banner) says where, the root says why. A UserError is
    kept as it is: its message already says why, in the user's terms."""
    found, current, seen = e, e, {id(e)}
    while not isinstance(current, UserError):
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
        if current is None or id(current) in seen:
            break
        seen.add(id(current))
        if ANSI_ESCAPE.sub("", str(current)).strip():  # one with an empty message says nothing: looked past
            found = current
    return found


def failure_reason(e: BaseException, limit: int | None = 300) -> str:
    """What a failed step's row says: the root exception's type and the first line of its message,
    in plain text."""
    return first_line(root_cause(e), True, limit)
