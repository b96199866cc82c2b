"""Exact references for the correctly rounded kernels, independent of refimpl's code: Python's Fraction sums
and an integer round-half-to-even to float32 (also via NumPy's own float64 -> float32 cast on exact values)."""

from fractions import Fraction

import numpy as np


def to_float32(value: Fraction) -> np.float32:
    """RNE32 of an exact rational (ties to even, overflow to inf, subnormals)."""
    if value == 0:
        return np.float32(0.0)
    sign, v = (-1 if value < 0 else 1), abs(value)
    e = v.numerator.bit_length() - v.denominator.bit_length()       # 2^(e-1) < v < 2^(e+1)
    if Fraction(2) ** e > v:
        e -= 1                                                       # now 2^e <= v < 2^(e+1)
    if e >= 128:
        return np.float32(sign * np.inf)
    spacing = Fraction(2) ** max(e - 23, -149)
    q, r = divmod(v, spacing)                                        # v = q spacing + r, 0 <= r < spacing
    if r > spacing / 2 or (r == spacing / 2 and q % 2 == 1):
        q += 1
    out = float(q * spacing)
    return np.float32(sign * out) if out < 2.0 ** 128 else np.float32(sign * np.inf)


def dot(a, b) -> Fraction:
    """The exact sum of products of two float vectors."""
    return sum((Fraction(float(x)) * Fraction(float(y)) for x, y in zip(np.ravel(a), np.ravel(b))), Fraction(0))


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """RNE32 of every exact element of a @ b (2-D float arrays)."""
    return np.array([[to_float32(dot(a[i], b[:, j])) for j in range(b.shape[1])] for i in range(a.shape[0])],
                    np.float32).reshape(a.shape[0], b.shape[1])


def sum_squares(x: np.ndarray) -> np.ndarray:
    """RNE32 of the exact sum of squares over the last axis."""
    flat = x.reshape(-1, x.shape[-1])
    return np.array([to_float32(dot(r, r)) for r in flat], np.float32).reshape(*x.shape[:-1], 1)


def mp_to_float32(y) -> np.float32:
    """RNE32 of an mpmath number (via its exact binary form)."""
    import mpmath
    if mpmath.isnan(y) or mpmath.isinf(y):
        return np.float32(float(y))
    sign, man, exp, _ = mpmath.mpf(y)._mpf_
    return to_float32((-1) ** sign * Fraction(man) * Fraction(2) ** exp)


def exp32(x) -> np.ndarray:
    """RNE32 of e^x at each (float64) x, by mpmath at 120 bits."""
    import mpmath
    with mpmath.workprec(120):
        return np.array([mp_to_float32(mpmath.exp(mpmath.mpf(float(v)))) for v in np.ravel(x)],
                        np.float32).reshape(np.shape(x))


def log_softmax_at(logits, token: int) -> float:
    """RNE32 of the exact log_softmax(logits)[token], by mpmath at 120 bits, as a Python float."""
    import mpmath
    with mpmath.workprec(120):
        total = mpmath.fsum(mpmath.exp(mpmath.mpf(float(v))) for v in np.ravel(logits))
        return float(mp_to_float32(mpmath.mpf(float(np.ravel(logits)[token])) - mpmath.log(total)))
