"""The one error type users see: a message that names what to fix, never a traceback."""


class AutoplanError(Exception):
    """A problem with the user's input (model file, cluster, options), stated in one line."""
