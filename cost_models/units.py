"""Units: sizes in bytes. The one place ``GIB`` and ``MIB`` are defined."""

MIB = 1024**2
GIB = 1024**3
