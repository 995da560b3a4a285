"""The error types users see: a message in one line, never a traceback.

:class:`AutoplanError` is the user's to fix (model file, cluster, options); :class:`InternalError` is
ours — an invariant of autoplan broke — and its message asks for a bug report. :func:`warn` issues an
:class:`AutoplanWarning`: about the user's model or files, so it names no line of autoplan's source.
"""

import warnings

REPORT_HINT = "this is a bug in autoplan, not in your input: please report it with the command you ran"


class AutoplanError(Exception):
    """A problem with the user's input (model file, cluster, options), stated in one line."""


class InternalError(Exception):
    """An invariant of autoplan broke; the message says which, and asks for a bug report."""

    def __str__(self) -> str:
        return f"{super().__str__()} ({REPORT_HINT})"


class AutoplanWarning(UserWarning):
    """Something about the user's model, cluster or files that the plan works around (``warnings`` category: filter
    it as ``warnings.filterwarnings("ignore", category=AutoplanWarning)``)."""


# each message once per process, unless the user's own filters say otherwise (theirs come first: appended)
warnings.filterwarnings("once", category=AutoplanWarning, append=True)


def warn(message: str) -> None:
    """Issue ``message`` as an :class:`AutoplanWarning` in one line: it concerns the user's input, so it points at
    no line of autoplan's source (shown as ``autoplan: AutoplanWarning: ...``). ``plan`` prints each once."""
    warnings.warn_explicit(message, AutoplanWarning, filename="autoplan", lineno=0, module="autoplan")
