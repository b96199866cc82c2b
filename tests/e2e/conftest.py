import pytest


@pytest.fixture(scope="session")
def htp_cases(tmp_path_factory):
    """arch -> htp_runs.Case, built once per test session (per worker): the HTP tests of every module share its
    exports, compiled graphs, goldens and dumps (tests/e2e/htp_runs.py)."""
    htp = pytest.importorskip("htp")
    if htp.unavailable():
        pytest.skip(htp.unavailable())
    import htp_runs
    built = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = htp_runs.case(arch, tmp_path_factory.mktemp(f"htp-{arch}"))
        return built[arch]
    return get
