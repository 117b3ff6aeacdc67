"""Cephes ``expf`` constants (S. L. Moshier, Cephes Math Library, expf.c), shared by the CPU kernels.

``exp(x) = 2**n * exp(r)``, ``n = round(x / ln 2)``, ``r = x - n ln 2`` (ln 2 split in two for
exactness), ``exp(r)`` by a degree-7 polynomial ``((((p0 r + p1) r + p2) r + p3) r + p4) r + p5) r^2 +
r + 1``; relative error ~1e-7 for ``x`` in ``[-87, 0]`` (clamped at -87 so ``2**n`` stays a normal
float). Each kernel takes them as float32 constants (:func:`float32_constants`).
"""

from __future__ import annotations

LOG2E = 1.44269504088896341
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4
POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
X_MIN = -87.0


def float32_constants() -> tuple:
    """``(log2e, ln2_hi, ln2_lo, p0, p1, p2, p3, p4, p5, x_min)`` as numpy float32 scalars."""
    import numpy as np

    return tuple(np.float32(c) for c in (LOG2E, LN2_HI, LN2_LO, *POLY, X_MIN))
