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


def warn(message: str) -> None:
    """Issue ``message`` as an :class:`AutoplanWarning` in one line: it concerns the user's input, so it points at
    no line of autoplan's source (shown as ``autoplan: AutoplanWarning: ...``). ``plan`` prints each once.

    Under Python's default action for a UserWarning each message is shown once: the registry is this module's
    ``__warningregistry__``, the one ``warnings.warn`` keeps for every module, so no filter of ours is installed and
    the user's filters decide ("always", "ignore", "error")."""
    registry = globals().setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        message, AutoplanWarning, filename="autoplan", lineno=0, module="autoplan", registry=registry
    )
