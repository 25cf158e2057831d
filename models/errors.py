"""One exception type for every user-facing failure: the CLI prints it as a single line."""
import unicodedata


class RemodelError(Exception):
    """Bad input or an impossible request; the message names the problem in one line."""


def one_line(msg: str) -> str:
    """`msg` with its control characters and line separators escaped as Python writes them (\\n, \\r,
    \\x1b, \\u2028): a path holding a newline must not split the one error line (or colour a terminal)."""
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in ("Cc", "Zl", "Zp")
                   else c for c in msg)
