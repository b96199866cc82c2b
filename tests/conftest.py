import os

import numpy as np
import pytest
from hypothesis import settings

# CI runs the same examples every time (no flaky landings); local runs keep exploring new ones
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def _no_disk_flush():
    """os.fsync returns at once in the test processes: it makes written data durable against a power loss, which no
    test can observe, and it does not change a byte (each bundle file's fsync cost ~0.7 ms of waiting on this
    machine's disk: 8,899 of them, 6.5 s, in test_golden / test_bundle / conventions / test_faults alone). Every
    writer still calls it where it does; tests/test_crash_points.py counts those calls in its order of file-system
    calls with its own stand-in."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: None)
        yield


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


@pytest.fixture(autouse=True)
def _xdist_group_kept(request):
    """--dist loadgroup keeps an `xdist_group` on one worker only when its tests' node ids end in `@group` (xdist's
    scheduler reads the group from the id): several groups share a session-scoped set-up (the HTP cases, the
    quantised models, a documentation page's blocks), spread over two workers it is built twice. pytest-xdist 3.8
    adds the suffix in a way pytest 9.2 ignores (pytest-xdist #1386; pyproject.toml pins pytest below it), and nothing
    else would tell: a grouped test whose id lost its group fails here."""
    nodeid = request.node.nodeid
    if (getattr(request.config.option, "loadgroup", False)          # set on xdist's workers under --dist loadgroup
            and request.node.get_closest_marker("xdist_group") and nodeid.rfind("@") <= nodeid.rfind("]")):
        pytest.fail(f"--dist loadgroup did not keep this test's xdist_group (its id {nodeid} has no @group): this "
                    f"pytest / pytest-xdist pair does not group tests (pytest-xdist #1386)", pytrace=False)
