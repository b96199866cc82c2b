"""Metrics (the formulas of refimpl.metrics, the rows of refimpl.diff.metrics): hand-computed values, identities
between metrics, zero / NaN / Inf cases, valid regions, logits."""

import json
import math
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refimpl.bundle import valid_mask
from refimpl.diff import metrics as M
from refimpl.errors import InputError
from refimpl.metrics import cosine, quantile_linear, ulp_distance

G = np.array([1.0, 2.0, 3.0, 4.0])
T = np.array([1.0, 2.0, 3.0, 5.0])


# --- hand-computed values on golden [1, 2, 3, 4], device [1, 2, 3, 5] --------------------------------


def test_hand_values_small_tensor():
    m = M.tensor_metrics(G.astype(np.float32), T.astype(np.float32))
    assert m["n"] == 4 and m["n_compared"] == 4
    assert m["n_nan"] == m["n_inf"] == m["golden_n_nan"] == m["golden_n_inf"] == 0
    assert m["max_abs"] == 1.0
    assert m["worst_index"] == [3]
    assert m["max_rel_polygraphy"] == 0.25  # 1 / |4|
    assert m["max_rel"] == 0.2  # 1 / max(4, 5)
    # reldiff [0, 0, 0, 0.25]; linear quantile at 0.99·3 = 2.97 -> 0.97·0.25
    assert m["rel_p99"] == pytest.approx(0.2425, rel=1e-12)
    assert m["mse"] == 0.25
    # Σgt = 34, Σg² = 30, Σt² = 39
    assert m["cosine"] == pytest.approx(34 / math.sqrt(30 * 39), rel=1e-12)
    assert m["nmse"] == pytest.approx(1 / 30, rel=1e-12)
    assert m["sqnr_db"] == pytest.approx(10 * math.log10(30), rel=1e-12)
    assert m["sqnr_qairt_db"] == pytest.approx(10 * math.log10((39 / 4) / (1 / 4)), rel=1e-12)
    assert m["psnr_db"] == pytest.approx(20 * math.log10((4 + 1e-5) / (0.5 + 1e-10)), rel=1e-12)
    # σ(g)² = 1.25, σ(t)² = 8.75 / 4
    assert m["std_ratio"] == pytest.approx(abs(math.sqrt(8.75 / 4) - math.sqrt(1.25)) / math.sqrt(1.25), rel=1e-12)
    # fp32 CANN defaults: 1 > 2^-16 + 2^-10·4 fails, the rest are exact
    assert (m["atol"], m["rtol"]) == (2.0**-16, 2.0**-10)
    assert m["not_close"] == 1 and m["not_close_frac"] == 0.25 and m["matched_ratio"] == 0.75
    # 4 -> 5 in fp32: mantissa steps of 2^-23·4, (5 - 4) / 2^-21 = 2^21
    assert m["ulp_max"] == 2.0**21 and m["ulp_mean"] == 2.0**21 / 4
    assert m["dtype"] == "float32"


@pytest.mark.parametrize("dtype, steps", [("fp16", 2**8), ("bf16", 2**5), ("float32", 2**21)])
def test_ulp_per_dtype_hand(dtype, steps):
    # between 4 and 8 the spacing is 4 · 2^-mantissa_bits: fp16 10 bits, bf16 7 bits, fp32 23 bits
    assert M.tensor_metrics(G, T, dtype=dtype)["ulp_max"] == steps


def test_rel_p99_matches_numpy_and_is_inf_safe(rng):
    x = rng.exponential(size=337)
    assert quantile_linear(x, 0.99) == pytest.approx(np.quantile(x, 0.99), rel=1e-14)
    assert quantile_linear([1.0, 2.0, np.inf], 0.99) == math.inf
    assert quantile_linear([1.0] * 200 + [np.inf], 0.99) == 1.0  # pos 198: both neighbours are 1
    g = np.array([1e-310] + [1.0] * 200)  # subnormal golden: its reldiff overflows to inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = M.tensor_metrics(g, g + 1.0)
    assert m["max_rel_polygraphy"] == math.inf and m["rel_p99"] == pytest.approx(1.0)
    assert m["max_rel"] == pytest.approx(1.0)


def test_isclose_boundary_is_inclusive():
    assert M.tensor_metrics(G, T, atol=1.0, rtol=0.0)["not_close"] == 0  # 1 <= 1 + 0
    assert M.tensor_metrics(G, T, atol=0.5, rtol=0.125)["not_close"] == 0  # 1 <= 0.5 + 0.125·4
    assert M.tensor_metrics(G, T, atol=0.5, rtol=0.12)["not_close"] == 1


def test_identical_tensors():
    m = M.tensor_metrics(G, G)
    assert m["max_abs"] == 0 and m["max_rel"] == 0 and m["rel_p99"] == 0 and m["nmse"] == 0
    assert m["sqnr_db"] == math.inf and m["sqnr_qairt_db"] == math.inf
    assert m["cosine"] == 1.0 and m["ulp_max"] == 0 and m["not_close"] == 0 and m["std_ratio"] == 0
    assert m["psnr_db"] == pytest.approx(20 * math.log10((4 + 1e-5) / 1e-10))


def test_json_serialisable_plain_types():
    m = M.tensor_metrics(G, T)
    for v in m.values():
        assert v is None or type(v) in (int, float, str, list)
    json.loads(json.dumps(m))
    lm = M.logits_metrics(np.zeros((2, 4)), np.ones((2, 4)))
    for v in lm.values():
        assert type(v) in (int, float)
    json.dumps(lm)


# --- identities --------------------------------------------------------------------------------------


@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=20), st.integers(0, 2**31 - 1))
def test_nmse_is_10_pow_minus_sqnr(values, seed):
    g = np.array(values)
    t = g + np.random.default_rng(seed).normal(0, 1, g.size)
    m = M.tensor_metrics(g, t)
    if 0 < m["nmse"] < math.inf:
        assert m["sqnr_db"] == pytest.approx(-10 * math.log10(m["nmse"]), rel=1e-9, abs=1e-9)
        if abs(m["sqnr_db"]) < 300:
            assert m["nmse"] == pytest.approx(10 ** (-m["sqnr_db"] / 10), rel=1e-9)
    elif m["nmse"] == 0:
        assert m["sqnr_db"] == math.inf
    else:  # nmse overflowed (or the golden is all zero): sqnr is below -10·log10(max float)
        assert m["sqnr_db"] < -3000


@pytest.mark.parametrize("c, expected", [(3.5, 1.0), (1e-3, 1.0), (-2.0, -1.0)])
def test_cosine_of_scaled_vector(rng, c, expected):
    x = rng.normal(size=100)
    assert cosine(x, c * x) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("dtype, ftype", [("fp32", np.float32), ("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)])
def test_ulp_nextafter_is_one(rng, dtype, ftype):
    x = rng.normal(size=50).astype(ftype)
    fi = ml_dtypes.finfo(ftype)
    x = np.concatenate([x, np.array([0, 1, -1, -fi.max, fi.max, fi.tiny, fi.smallest_subnormal], ftype)])
    assert (ulp_distance(x, _next_up(x), dtype) == 1).all()
    assert (ulp_distance(_next_up(x), x, dtype) == 1).all()
    assert (ulp_distance(x, x, dtype) == 0).all()


def _next_up(x):
    """The next representable value above x in x's own dtype (ml_dtypes registers nextafter for bf16)."""
    with np.errstate(over="ignore"):  # max -> inf, one step past max
        return np.nextafter(x, np.full_like(x, np.inf))


def test_ulp_signed_zero_and_across_zero():
    assert ulp_distance(0.0, -0.0, "fp32") == 0
    tiny = np.float32(np.nextafter(np.float32(0), np.float32(1)))  # smallest subnormal
    assert ulp_distance(tiny, -tiny, "fp32") == 2
    assert ulp_distance(-tiny, 0.0, "fp32") == 1
    # ±inf sit one step past ±max; NaN gives NaN
    assert ulp_distance(np.finfo(np.float16).max, np.inf, "fp16") == 1
    assert np.isnan(ulp_distance(np.nan, 1.0, "fp32"))


def test_ulp_rounds_to_dtype_first():
    # 1 + 2^-10 is not a bf16 value: it rounds to 1.0, so the distance in bf16 is 0 (fp32: 2^13)
    assert ulp_distance(1.0, 1.0 + 2**-10, "bf16") == 0
    assert ulp_distance(1.0, 1.0 + 2**-10, "fp32") == 2**13
    assert ulp_distance(1.0, 1.0 + 2**-7, np.dtype(ml_dtypes.bfloat16)) == 1


def test_ulp_bad_dtype():
    with pytest.raises(InputError, match="fp32 / fp16 / bf16"):
        ulp_distance(1.0, 2.0, "int8")


# --- degenerate tensors ------------------------------------------------------------------------------


def test_all_zero_golden_and_device():
    z = np.zeros(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent divide-by-zero warnings
        m = M.tensor_metrics(z, z)
    assert m["nmse"] == 0.0 and m["sqnr_db"] == math.inf and m["sqnr_qairt_db"] == math.inf
    assert m["cosine"] == 1.0 and m["max_rel"] == 0.0 and m["max_rel_polygraphy"] == 0.0
    assert m["psnr_db"] == pytest.approx(100.0)  # 20·log10(1e-5 / 1e-10)
    assert m["std_ratio"] == 0.0 and m["not_close"] == 0


def test_all_zero_golden_nonzero_device():
    z, t = np.zeros(4), np.array([0.0, 0.0, 0.0, 1e-3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = M.tensor_metrics(z, t)
    assert m["nmse"] == math.inf and m["sqnr_db"] == -math.inf
    assert m["sqnr_qairt_db"] == pytest.approx(0.0)  # mean(t²) == mse when g = 0
    assert m["cosine"] == 0.0
    assert m["max_rel"] == 1.0  # symmetric form stays bounded
    assert m["max_rel_polygraphy"] == pytest.approx(1e-3 / 2.22e-16)
    assert m["psnr_db"] == pytest.approx(20 * math.log10(1e-5 / (math.sqrt(1e-6 / 4) + 1e-10)))
    assert m["std_ratio"] == 100.0


def test_zero_device_nonzero_golden():
    m = M.tensor_metrics(G, np.zeros(4))
    assert m["cosine"] == 0.0 and m["nmse"] == 1.0 and m["sqnr_db"] == 0.0
    assert m["sqnr_qairt_db"] == -math.inf


def test_empty_valid_region():
    m = M.tensor_metrics(G, T, valid=[[[0, 0]]])
    assert m["n"] == 0 and m["n_compared"] == 0 and m["worst_index"] is None
    for key in ("max_abs", "cosine", "sqnr_db", "nmse", "psnr_db", "rel_p99", "not_close_frac", "ulp_max"):
        assert math.isnan(m[key]), key


# --- NaN / Inf in dumps ------------------------------------------------------------------------------


def test_nan_inf_in_device_counted_and_finite_metrics_computed():
    t = np.array([1.0, np.nan, 3.0, 5.0, np.inf, -np.inf, 7.0], np.float32)
    g = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = M.tensor_metrics(g, t)
    assert (m["n"], m["n_compared"], m["n_nan"], m["n_inf"]) == (7, 4, 1, 2)
    # the finite elements are [1, 3, 4, 7] vs [1, 3, 5, 7]
    ref = M.tensor_metrics(np.array([1.0, 3, 4, 7]), np.array([1.0, 3, 5, 7]))
    for key in ("max_abs", "max_rel", "rel_p99", "mse", "cosine", "sqnr_db", "nmse", "psnr_db", "ulp_max"):
        assert m[key] == ref[key], key
    assert m["worst_index"] == [3]
    # not-close is over all 7: the NaN and both infinities fail, plus 4 vs 5
    assert m["not_close"] == 4 and m["not_close_frac"] == pytest.approx(4 / 7)


def test_matching_infinities_are_close_nan_never():
    g = np.array([np.inf, -np.inf, np.nan, 1.0])
    t = np.array([np.inf, np.inf, np.nan, 1.0])
    m = M.tensor_metrics(g, t)
    assert m["golden_n_inf"] == 2 and m["golden_n_nan"] == 1 and m["n_inf"] == 2 and m["n_nan"] == 1
    assert m["n_compared"] == 1 and m["not_close"] == 2  # -inf vs inf, NaN vs NaN
    assert m["max_abs"] == 0.0


def test_all_nan_device():
    m = M.tensor_metrics(G, np.full(4, np.nan))
    assert m["n_nan"] == 4 and m["n_compared"] == 0 and m["not_close_frac"] == 1.0
    assert math.isnan(m["cosine"]) and math.isnan(m["ulp_max"])


# --- valid region ------------------------------------------------------------------------------------


def test_invalid_region_is_ignored(rng):
    g = rng.normal(size=(4, 6)).astype(np.float32)
    t = (g + rng.normal(scale=1e-3, size=g.shape)).astype(np.float32)
    boxes = [[[0, 2], [0, 6]], [[2, 4], [0, 3]]]
    before = M.tensor_metrics(g, t, valid=boxes)
    t2 = t.copy()
    t2[2:, 3:] = 1e30  # don't-care slots
    t2[3, 5] = np.nan
    after = M.tensor_metrics(g, t2, valid=boxes)
    assert after == before
    assert before["n"] == 18
    # the same region given as a mask; the don't-care error shows up once scored
    assert M.tensor_metrics(g, t2, valid=valid_mask(g.shape, boxes)) == before
    assert M.tensor_metrics(g, t2)["max_abs"] > 1e29


def test_worst_index_is_in_full_tensor_coordinates():
    g = np.zeros((3, 4))
    t = g.copy()
    t[2, 1] = 0.5
    t[0, 0] = 9.0  # outside the valid box
    assert M.tensor_metrics(g, t, valid=[[[1, 3], [0, 4]]])["worst_index"] == [2, 1]


def test_bad_shapes_and_masks():
    with pytest.raises(InputError, match="shape"):
        M.tensor_metrics(G, T[:3])
    with pytest.raises(InputError, match="valid mask"):
        M.tensor_metrics(G, T, valid=np.ones(3, bool))


def test_bf16_inputs(rng):
    g = rng.normal(size=32).astype(np.float32)
    t = g.astype(ml_dtypes.bfloat16)
    m = M.tensor_metrics(g, t, dtype="bf16")
    assert m["ulp_max"] == 0  # t is g rounded to bf16: same bf16 value
    assert m["not_close"] == 0  # bf16 rounding error 2^-9·|g| < 2^-6 + 2^-6·|g|
    assert 0 < m["max_rel_polygraphy"] <= 2.0**-8


# --- logits ------------------------------------------------------------------------------------------


def test_identical_logits(rng):
    x = rng.normal(size=(3, 7, 50))
    m = M.logits_metrics(x, x.copy(), k=5)
    assert m["n_rows"] == m["n_rows_scored"] == 21
    assert m["top1_agreement"] == 1.0 and m["top1_flips"] == 0 and m["topk_overlap_mean"] == 1.0
    assert m["kl_over_lnv_mean"] == 0.0 and m["kl_over_lnv_max"] == 0.0
    assert m["dp_top_mean"] == 0.0 and m["dp_top_max"] == 0.0


def test_swapped_top_token():
    g = np.array([[5.0, 1.0, 0.0, -1.0]])
    t = np.array([[1.0, 5.0, 0.0, -1.0]])
    m = M.logits_metrics(g, t, k=2)
    assert m["top1_agreement"] == 0.0 and m["top1_flips"] == 1
    assert m["topk_overlap_mean"] == 1.0  # same top-2 set {0, 1}
    assert M.logits_metrics(g, t, k=1)["topk_overlap_mean"] == 0.0
    p = np.exp(g[0]) / np.exp(g[0]).sum()
    assert m["dp_top_max"] == pytest.approx(abs(p[1] - p[0]), rel=1e-12)  # q(0) = p(1) by symmetry
    assert m["kl_over_lnv_mean"] > 0


def test_kl_three_token_vocabulary_by_hand():
    # p = [1, 2, 3] / 6 from logits ln[1, 2, 3]; q uniform from equal logits
    g = np.log(np.array([[1.0, 2.0, 3.0]]))
    t = np.zeros((1, 3))
    kl = (1 / 6) * math.log(0.5) + (2 / 6) * math.log(1.0) + (3 / 6) * math.log(1.5)
    m = M.logits_metrics(g, t, k=2)
    assert m["kl_over_lnv_mean"] == pytest.approx(kl / math.log(3), rel=1e-12)
    assert m["kl_over_lnv_last"] == m["kl_over_lnv_max"] == m["kl_over_lnv_mean"]
    assert m["dp_top_max"] == pytest.approx(abs(1 / 3 - 1 / 2), rel=1e-12)
    assert m["top1_agreement"] == 0.0  # uniform device argmax ties go to token 0
    assert m["topk_overlap_mean"] == 0.5  # {2, 1} vs {0, 1}


def test_kl_mean_max_over_rows():
    g = np.log(np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]]))
    t = np.zeros((2, 3))
    m = M.logits_metrics(g, t)
    kl0 = ((1 / 6) * math.log(0.5) + 0.5 * math.log(1.5)) / math.log(3)
    assert m["kl_over_lnv_max"] == pytest.approx(kl0, rel=1e-12)
    assert m["kl_over_lnv_mean"] == pytest.approx(kl0 / 2, rel=1e-12)
    assert m["kl_over_lnv_last"] == 0.0


@given(st.integers(0, 2**31 - 1), st.floats(0.01, 30))
def test_kl_nonnegative_and_shift_invariant(seed, scale):
    r = np.random.default_rng(seed)
    g, t = r.normal(scale=scale, size=(4, 11)), r.normal(scale=scale, size=(4, 11))
    m = M.logits_metrics(g, t)
    assert m["kl_over_lnv_mean"] >= 0 and m["kl_over_lnv_max"] >= m["kl_over_lnv_mean"]
    assert 0 <= m["dp_top_max"] <= 1 and 0 <= m["top1_agreement"] <= 1
    shifted = M.logits_metrics(g + 1000.0, t - 1000.0)  # softmax is shift-invariant and computed stably
    assert shifted["kl_over_lnv_mean"] == pytest.approx(m["kl_over_lnv_mean"], rel=1e-6, abs=1e-12)


def test_logits_valid_rows_and_nonfinite_rows():
    g = np.zeros((2, 3, 4))
    g[..., 0] = 3.0
    t = g.copy()
    t[1, 2] = [0.0, 9.0, 0.0, 0.0]  # a flip in row 5
    t[0, 1, 2] = np.nan  # row 1 non-finite
    m = M.logits_metrics(g, t)
    assert (m["n_rows"], m["n_rows_nonfinite"], m["n_rows_scored"]) == (6, 1, 5)
    assert m["top1_flips"] == 1 and m["top1_agreement"] == pytest.approx(4 / 5)
    mask = np.ones((2, 3), bool)
    mask[1, 2] = False
    m2 = M.logits_metrics(g, t, valid_rows=mask)
    assert m2["top1_flips"] == 0 and m2["n_rows_scored"] == 4
    m3 = M.logits_metrics(g, t, valid_rows=[0, 2])
    assert m3["n_rows"] == 2 and m3["top1_agreement"] == 1.0 and m3["kl_over_lnv_max"] == 0.0
    m4 = M.logits_metrics(g, t, valid_rows=[1])
    assert m4["n_rows_scored"] == 0 and math.isnan(m4["kl_over_lnv_mean"])


def test_logits_bad_input():
    with pytest.raises(InputError, match="vocabulary"):
        M.logits_metrics(np.zeros((2, 1)), np.zeros((2, 1)))
    with pytest.raises(InputError, match="shape"):
        M.logits_metrics(np.zeros((2, 3)), np.zeros((3, 3)))


def test_topk_indices_is_the_stable_sorts_first_k():
    """topk_indices (np.partition, then the candidates sorted) against the whole stable argsort: ties to the lower
    index, -0.0 equal to 0.0, non-finite rows and k >= V included."""
    rng = np.random.default_rng(7)
    for trial in range(200):
        R, V = int(rng.integers(0, 4)), int(rng.integers(1, 24))
        x = rng.integers(-3, 3, (R, V)).astype(np.float32) if trial % 2 else rng.standard_normal((R, V))
        if R and trial % 5 == 0:
            x[rng.integers(0, R), rng.integers(0, V)] = [-0.0, np.nan, -np.inf, np.inf][trial % 4]
        for k in range(1, V + 2):
            want = np.argsort(-np.asarray(x, np.float64), axis=-1, kind="stable")[:, :k]
            np.testing.assert_array_equal(M.topk_indices(x, k), want, err_msg=f"{x} k={k}")
