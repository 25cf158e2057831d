"""One exception type for every user-facing failure: the CLI prints it as a single line."""


class RemodelError(Exception):
    """Bad input or an impossible request; the message names the problem in one line."""
