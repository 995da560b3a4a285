"""The error types users see: a message in one line, never a traceback.

:class:`AutoplanError` is the user's to fix (model file, cluster, options); :class:`InternalError` is
ours — an invariant of autoplan broke — and its message asks for a bug report.
"""

REPORT_HINT = "this is a bug in autoplan, not in your input: please report it with the command you ran"


class AutoplanError(Exception):
    """A problem with the user's input (model file, cluster, options), stated in one line."""


class InternalError(Exception):
    """An invariant of autoplan broke; the message says which, and asks for a bug report."""

    def __str__(self) -> str:
        return f"{super().__str__()} ({REPORT_HINT})"
