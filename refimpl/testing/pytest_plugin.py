"""pytest fixtures and hypothesis profiles for testing kernels against refimpl.

Enable it in your conftest.py:   pytest_plugins = ["refimpl.testing.pytest_plugin"]

Fixtures:
  refimpl_reference     case -> refimpl's float64 answer (Case.reference)
  refimpl_assert_close  refimpl.testing.assert_close
  refimpl_dtype         parametrises a test over the device dtypes of --refimpl-dtypes (default
                        float16,bfloat16,float32)
Hypothesis profiles (select with --hypothesis-profile=NAME, hypothesis' own option):
  refimpl       no deadline (reference kernels are NumPy loops), 100 examples
  refimpl-ci    the same, derandomized (the same examples on every run) and without the example database
"""

import pytest

from .tolerance import assert_close, dtype_of

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # fixtures still work; only the profiles need hypothesis
    settings = None

if settings is not None:
    _common = dict(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("refimpl", **_common)
    settings.register_profile("refimpl-ci", derandomize=True, database=None, print_blob=True, **_common)


def pytest_addoption(parser):
    parser.addoption("--refimpl-dtypes", default="float16,bfloat16,float32",
                     help="device dtypes for the refimpl_dtype fixture (comma-separated)")


def pytest_generate_tests(metafunc):
    if "refimpl_dtype" in metafunc.fixturenames:
        names = [d.strip() for d in metafunc.config.getoption("--refimpl-dtypes").split(",") if d.strip()]
        metafunc.parametrize("refimpl_dtype", [dtype_of(d).name for d in names], ids=names)


@pytest.fixture
def refimpl_reference():
    """A function case -> reference output(s) in float64."""
    return lambda case: case.reference()


@pytest.fixture
def refimpl_assert_close():
    return assert_close
