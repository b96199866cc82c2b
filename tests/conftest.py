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


# the modules whose tests take longest (tens of seconds each, or a long module-scoped set-up): collected first, so that
# `make test`'s two xdist workers start them early and end on short tests (--dist loadgroup hands out tests in
# collection order, after the xdist groups, largest first); modules stay whole, in their own order
LONG_FIRST = ("tests/e2e/", "tests/test_platforms.py", "tests/models/test_streaming.py",
              "tests/dataset/test_reference.py", "tests/test_generate.py", "tests/test_crash_points.py")


def pytest_collection_modifyitems(config, items):
    rank = {prefix: i for i, prefix in enumerate(LONG_FIRST)}

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return next((rank[p] for p in LONG_FIRST if path.startswith(p)), len(LONG_FIRST))
    items.sort(key=key)                  # stable: the rest keep pytest's order
