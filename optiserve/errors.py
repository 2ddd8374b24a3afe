"""The one exception type the CLI turns into a single readable line instead of a traceback."""


class UserError(Exception):
    """Bad input from the user (an option, a path, a file): the message says what is wrong and how to fix it."""
