"""refimpl.testing: test your own kernels against refimpl (docs/testing.md).

    from refimpl.testing import assert_close, make_sdpa_case      # NumPy only
    from refimpl.testing.strategies import sdpa_cases             # needs hypothesis ('refimpl[testing]')

A Case holds a kernel's inputs in the device dtype and its reference (refimpl in float64 on those inputs);
`case.check(actual)` / `assert_close(actual, expected, dtype=...)` judge with dtype-aware tolerances
(tolerance.py) and name the worst element on failure. pytest fixtures and hypothesis profiles:
`pytest_plugins = ["refimpl.testing.pytest_plugin"]` in your conftest.py.

The strategies are importable from here too (lazily: hypothesis is loaded on first use, with a clear error if
it is missing).
"""

from .cases import (
    MASK_FLOORS,
    Case,
    Output,
    check_routing,
    make_conv1d_case,
    make_gated_delta_case,
    make_moe_routing_case,
    make_rms_norm_case,
    make_rope_case,
    make_sdpa_case,
)
from .tolerance import GROWTH, Tolerance, assert_close, compare, dtype_of, rel_rmse, tolerance, unit_roundoff

_STRATEGIES = ("rope_cases", "sdpa_cases", "rms_norm_cases", "gated_delta_cases", "conv1d_cases",
               "moe_routing_cases")

__all__ = ["assert_close", "compare", "tolerance", "Tolerance", "GROWTH", "unit_roundoff", "rel_rmse", "dtype_of",
           "Case", "Output", "check_routing", "MASK_FLOORS", "make_rope_case", "make_sdpa_case",
           "make_rms_norm_case", "make_gated_delta_case", "make_conv1d_case", "make_moe_routing_case",
           *_STRATEGIES]


def __getattr__(name):
    if name in _STRATEGIES:
        from . import strategies  # ImportError with install instructions when hypothesis is absent
        return getattr(strategies, name)
    raise AttributeError(f"module 'refimpl.testing' has no attribute {name!r}")
