import os

import numpy as np
import pytest
from hypothesis import settings

# CI runs the same examples every time (no flaky landings); local runs keep exploring new ones
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
def rng():
    return np.random.default_rng(0)
