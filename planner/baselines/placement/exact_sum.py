"""``math.fsum`` in compiled code, for the batched placement simulator's sums to equal the simulator's.

The simulator adds seconds and bytes with ``math.fsum`` (exactly rounded: the float nearest the exact
sum); :func:`fsum_prefix` is CPython's algorithm (``Modules/mathmodule.c``, ``math_fsum``: Shewchuk's
non-overlapping partials, Shewchuk 1997, "Adaptive precision floating-point arithmetic", then the
round-half-to-even correction of the last two partials) for finite values, compiled by numba so that
:mod:`planner.baselines.placement.batched_simulator` can call it from its kernels. Infinities and NaNs,
which placement problems do not hold, are not special-cased as CPython does.
"""

from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True)
def fsum_prefix(values, count, partials):
    """``math.fsum(values[:count])``: CPython's algorithm (Shewchuk's partials, then round half to even)."""
    n = 0
    for k in range(count):
        x = values[k]
        i = 0
        for j in range(n):
            y = partials[j]
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo != 0.0:
                partials[i] = lo
                i += 1
            x = hi
        n = i
        if x != 0.0:
            partials[n] = x
            n += 1
    if n == 0:
        return 0.0
    n -= 1
    hi = partials[n]
    lo = 0.0
    while n > 0:
        x = hi
        n -= 1
        y = partials[n]
        hi = x + y
        lo = y - (hi - x)
        if lo != 0.0:
            break
    if n > 0 and ((lo < 0.0 and partials[n - 1] < 0.0) or (lo > 0.0 and partials[n - 1] > 0.0)):
        y = lo * 2.0
        x = hi + y
        if y == x - hi:
            hi = x
    return hi
