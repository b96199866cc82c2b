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

    def get(arch: str, ar: int = 8):
        """ar = 16: the same model on htp_runs.LONG_PROMPT (its own export, goldens and dumps)."""
        if (arch, ar) not in built:
            built[(arch, ar)] = (htp_runs.case(arch, tmp_path_factory.mktemp(f"htp-{arch}")) if ar == 8 else
                                 htp_runs.long_case(get(arch), tmp_path_factory.mktemp(f"htp-{arch}-ar{ar}")))
        return built[(arch, ar)]
    return get


@pytest.fixture(scope="session")
def quantised_dense(tmp_path_factory):
    """tiny-qwen3's float graph for the quantised HTP (tests/e2e/quantised.py) and its QDQ models, built once per test
    session: (case, {mix: (ModelProto, path)}). test_quantised_htp.py and test_quantised_refimpl.py both judge them
    (one xdist group, "quantised"); each built the same export and quantisations of its own before."""
    import quantised as Q
    case = Q.float_case("dense", tmp_path_factory.mktemp("quantised-dense"))
    return case, {mix: (Q.quantise_qdq(case, mix), case.path.with_name(f"qdq_{mix}_{case.path.stem}.onnx"))
                  for mix in Q.MIXES}   # quantise_qdq's own file name
