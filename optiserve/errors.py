"""The one exception type the CLI turns into a single readable line instead of a traceback."""


class UserError(Exception):
    """Bad input from the user (an option, a path, a file): the message says what is wrong and how to fix it."""


def first_line(e: BaseException, with_type: bool = False, limit: int | None = None) -> str:
    """The first line of an exception's message, cut at `limit` characters (what a one-line error
    quotes of a library's long message); prefixed with the exception's type when `with_type`; the
    type's name alone when the message is empty."""
    text = str(e).strip()
    line = text.splitlines()[0][:limit] if text else ""
    if not line:
        return type(e).__name__
    return f"{type(e).__name__}: {line}" if with_type else line
