"""refimpl.diff.classify on synthetic tensors: every fault class planted by hand at several magnitudes on random
shapes (hypothesis), with its fitted parameters checked; honest reduced-precision rounding is always 'precision';
nothing is ever given a wrong class (a planted fault is named right or 'unexplained')."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from refimpl.diff import classify
from refimpl.errors import InputError

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw, min_size=4):
    """A float32 reference of 2-4 axes of 4-12 (at least one axis of 8+), at a scale of 1e-3 .. 1e3."""
    ndim = draw(st.integers(2, 4))
    shape = [draw(st.integers(min_size, 12)) for _ in range(ndim)]
    shape[draw(st.integers(0, ndim - 1))] = draw(st.integers(8, 16))
    seed = draw(st.integers(0, 2 ** 31))
    scale = 10.0 ** draw(st.integers(-3, 3))
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32), seed


def _slices(draw, n):
    k = draw(st.integers(1, max(1, n // 2)))
    return sorted(draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True)))


def _at(x, axis, idx):
    sl = [slice(None)] * x.ndim
    sl[axis] = idx
    return tuple(sl)


@given(tensors(), st.sampled_from([0.5, 0.9, 0.99, 0.998, 1.002, 1.02, 1.1, 2.0]))
@SETTINGS
def test_whole_tensor_gain(t, c):
    r, _ = t
    f = classify(r, (r * c).astype(np.float32))
    assert f.kind == "gain" and abs(f.params["factor"] / c - 1) < 0.01, f


@given(tensors(), st.sampled_from([0.5, 0.98, 1.005, 1.05, 3.0]), st.data())
@SETTINGS
def test_gain_on_some_slices(t, c, data):
    r, _ = t
    axis = data.draw(st.integers(0, r.ndim - 1))
    idx = _slices(data.draw, r.shape[axis])
    d = r.copy()
    d[_at(d, axis, idx)] *= np.float32(c)
    f = classify(r, d)
    assert f.kind == "gain", f
    if "axis" in f.params:
        assert f.params["axis"] == axis and f.params["slices"] == idx, f
        assert all(abs(v / c - 1) < 0.01 for v in f.params["factors"]), f
    else:
        assert len(idx) == r.shape[axis] or r.size // r.shape[axis] == 1, f


@given(tensors(), st.sampled_from([1e-3, 0.05, 1.0]), st.data())
@SETTINGS
def test_offset_on_some_slices(t, b, data):
    r, _ = t
    axis = data.draw(st.integers(0, r.ndim - 1))
    idx = _slices(data.draw, r.shape[axis])
    b = b * float(np.sqrt(np.mean(r.astype(np.float64) ** 2)))
    d = r.copy()
    d[_at(d, axis, idx)] += np.float32(b)
    f = classify(r, d)
    assert f.kind == "offset", f
    if "axis" in f.params:
        assert f.params["axis"] == axis and f.params["slices"] == idx, f
        assert all(abs(v / b - 1) < 0.01 for v in f.params["offsets"]), f


@given(tensors(), st.data())
@SETTINGS
def test_permuted_slices(t, data):
    r, _ = t
    axis = data.draw(st.integers(0, r.ndim - 1))
    S = r.shape[axis]
    perm = np.array(data.draw(st.permutations(range(S))))
    assume(not np.array_equal(perm, np.arange(S)))
    assume(not any(np.array_equal(perm, (np.arange(S) + s) % S) for s in range(S)))   # a roll is a shift
    f = classify(r, np.take(r, perm, axis=axis))
    assert f.kind == "permutation" and f.params["axis"] == axis and f.params["perm"] == perm.tolist(), f


@given(tensors(), st.sampled_from([1, -1, 2, -2]), st.data())
@SETTINGS
def test_shift(t, s, data):
    r, _ = t
    axis = data.draw(st.integers(0, r.ndim - 1))
    S = r.shape[axis]
    assume(S >= 4 * abs(s))                                # the overlap holds most of the tensor
    d = np.zeros_like(r)                                   # device[i] = reference[i + s], vacated slots zero
    src, dst = (range(s, S), range(0, S - s)) if s > 0 else (range(0, S + s), range(-s, S))
    d[_at(d, axis, list(dst))] = r[_at(r, axis, list(src))]
    f = classify(r, d)
    assert f.kind == "shift" and f.params == {"axis": axis, "by": s}, f


@given(tensors())
@SETTINGS
def test_stale_state(t):
    r, seed = t
    prev = np.random.default_rng(seed + 1).standard_normal(r.shape).astype(np.float32) * np.abs(r).max()
    f = classify(r, prev, previous=prev)
    assert f.kind == "stale state" and f.params["equals"] == "the previous step's value", f
    f = classify(r, np.zeros_like(r), previous=prev)
    assert f.kind == "stale state" and f.params["equals"] == "the initial (zero) state", f
    f = classify(r, np.zeros_like(r), state=True)                     # a state input, no previous step
    assert f.kind == "stale state" and f.params["equals"] == "the initial (zero) state", f
    assert classify(r, np.zeros_like(r)).kind == "masked region"       # an activation of zeros


@given(tensors(), st.sampled_from([0.5, 0.8, 0.95]), st.booleans())
@SETTINGS
def test_saturation(t, q, both):
    r, _ = t
    hi = float(np.quantile(r, q))
    lo = float(np.quantile(r, 1 - q)) if both else -np.inf
    f = classify(r, np.clip(r, lo, hi))
    assert f.kind == "saturation" and math.isclose(f.params["hi"], hi, rel_tol=1e-6), f
    assert (f.params["lo"] is None) if not both else math.isclose(f.params["lo"], lo, rel_tol=1e-6), f


def test_fp16_overflow_is_named():
    r = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * 4e4
    f = classify(r, np.clip(r, -65504, 65504))
    assert f.kind == "saturation" and "float16 max" in f.summary, f
    f = classify(r, r.astype(np.float16).astype(np.float32), dtype="fp16")
    assert f.kind == "non-finite" and f.params["n_inf"] == int((np.abs(r) > 65520).sum()), f


@given(tensors(), st.integers(1, 5), st.booleans())
@SETTINGS
def test_non_finite(t, k, nan):
    r, seed = t
    d = r.copy()
    flat = np.random.default_rng(seed).choice(r.size, k, replace=False)
    d.ravel()[flat] = np.nan if nan else np.inf
    f = classify(r, d)
    assert f.kind == "non-finite" and f.params["n_nan" if nan else "n_inf"] == k, f


@given(tensors(), st.data())
@SETTINGS
def test_zeroed_slices_are_a_masked_region(t, data):
    r, _ = t
    axis = data.draw(st.integers(0, r.ndim - 1))
    idx = _slices(data.draw, r.shape[axis])
    d = r.copy()
    d[_at(d, axis, idx)] = 0
    f = classify(r, d)
    assert f.kind == "masked region" and f.params["n"] == int((r[_at(r, axis, idx)] != 0).sum()), f


def test_mask_floor_is_a_masked_region():
    mask = np.where(np.tril(np.ones((8, 32), bool), 24), 0.0, -1000.0).astype(np.float32)
    f = classify(mask, np.maximum(mask, -50))
    assert f.kind == "masked region" and f.params["lo"] == -50 and f.params["reference_floor"] == -1000, f


@given(tensors(), st.data())
@SETTINGS
def test_sign_and_swap(t, data):
    r, _ = t
    even = [a for a, s in enumerate(r.shape) if s % 2 == 0]
    kind = data.draw(st.sampled_from(["negated", "swapped", "rotate_half"] if even else ["negated"]))
    if kind == "negated":
        d, expect = -r, {"factor": -1.0}
    else:
        a = data.draw(st.sampled_from(even))
        r1, r2 = np.split(r, 2, axis=a)
        d = np.concatenate([r2, r1] if kind == "swapped" else [-r2, r1], axis=a)
        expect = {"axis": a, "swapped": True, "signs": [1, 1] if kind == "swapped" else [-1, 1]}
    f = classify(r, d)
    assert f.kind == "sign/swap" and f.params == expect, f


def test_layout_transposed_bytes():
    r = np.random.default_rng(0).standard_normal((2, 1, 16, 8)).astype(np.float32)   # [Hkv, 1, D, T]
    d = r.transpose(0, 1, 3, 2).reshape(r.shape)      # [Hkv, 1, T, D] bytes in the [Hkv, 1, D, T] buffer
    f = classify(r, d)
    assert f.kind == "permutation" and f.params == {"layout": "bytes", "axes": [0, 1, 3, 2]}, f


def test_alternatives_name_a_convention():
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    wrong = x[:, [0, 2, 4, 6, 1, 3, 5, 7]] * 1.5 + 0.25             # any computed alternative
    f = classify(x, wrong, alternatives={"permutation: RoPE over interleaved pairs": wrong})
    assert f.kind == "permutation" and f.summary == "RoPE over interleaved pairs", f


# ------------------------------------------------------------------------------------------------ honest devices

ROUND = {"fp16": lambda x: x.astype(np.float16).astype(np.float32),
         "bf16": lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)}


@given(tensors(), st.sampled_from(["fp16", "bf16", "int8", "int16"]), st.integers(1, 8))
@SETTINGS
def test_honest_reduced_precision_is_precision_only(t, dtype, ops):
    """The reference rounded to the device's grid, and `ops` rounding errors of the same size accumulated."""
    r, seed = t
    rng = np.random.default_rng(seed)
    if dtype in ROUND:
        d = ROUND[dtype](r)
        u = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}[dtype]
        d = ROUND[dtype](d * (1 + u * rng.uniform(-1, 1, r.shape) * math.sqrt(ops)))
    else:
        s = np.abs(r).max() / (2 ** (int(dtype[3:]) - 1) - 1)
        d = (np.round(r / s) * s).astype(np.float32)
    f = classify(r, d, dtype=dtype)
    assert f.kind == "precision", f


@given(tensors(), st.sampled_from([1e-6, 1e-4, 1e-2, 1.0]))
@SETTINGS
def test_noise_is_never_a_fault(t, level):
    """Random error of every size: 'precision' under the floor, 'unexplained' above it, never a named fault."""
    r, seed = t
    d = r + level * np.abs(r).max() * np.random.default_rng(seed + 1).standard_normal(r.shape).astype(np.float32)
    assert classify(r, d).kind in ("precision", "unexplained")


def test_valid_region_and_bad_input():
    r = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    d = r.copy()
    d[:, 12:] = 99                                             # outside the valid region: not compared
    assert classify(r, d, valid=[[[0, 4], [0, 12]]]).kind == "precision"
    d[:, :12] *= 1.1
    f = classify(r, d, valid=[[[0, 4], [0, 12]]])
    assert f.kind == "gain" and abs(f.params["factor"] - 1.1) < 1e-4, f
    with pytest.raises(InputError, match="shape"):
        classify(r, r[:2])
    with pytest.raises(InputError, match="dtype"):
        classify(r, r, dtype="fp8")
    assert classify(r, r * 1.1).to_dict()["class"] == "gain"


def test_sweep_right_at_least_95_percent_never_wrong():
    """A deterministic sweep over every class (5 magnitudes / variants each, 4 shapes): >= 95 % named right with
    the right parameters, the rest unexplained / precision; the table is the test's failure message."""
    table = {}
    for shape in [(1, 7, 4, 16), (2, 1, 16, 8), (12, 64), (1, 5, 2, 32)]:
        r = np.random.default_rng(len(shape) + shape[-1]).standard_normal(shape).astype(np.float32)
        for kind, d, ok in _planted(r):
            f = classify(r, d)
            verdict = "right" if f.kind == kind and ok(f.params) else (
                "unexplained" if f.kind in ("unexplained", "precision") else "wrong")
            table.setdefault(kind, {"right": 0, "unexplained": 0, "wrong": 0})[verdict] += 1
    total = {v: sum(t[v] for t in table.values()) for v in ("right", "unexplained", "wrong")}
    assert total["wrong"] == 0 and total["right"] >= 0.95 * sum(total.values()), table


def _planted(r):
    """(class, device, parameter check) for each planted fault on r."""
    last, S = r.ndim - 1, r.shape[-1]
    for c in (0.5, 0.99, 1.003, 1.05, 4.0):
        yield "gain", r * np.float32(c), lambda p, c=c: abs(p["factor"] / c - 1) < 0.01
        d = r.copy()
        d[..., 1:3] *= np.float32(c)
        yield "gain", d, lambda p, c=c: p.get("slices") == [1, 2] and all(abs(v / c - 1) < .01 for v in p["factors"])
    rms = float(np.sqrt(np.mean(r.astype(np.float64) ** 2)))
    for b in (1e-3, 0.01, 0.1, 1.0, 5.0):
        d = r.copy()
        d[..., : S // 2] += np.float32(b * rms)
        yield "offset", d, lambda p, b=b: p.get("slices") == list(range(S // 2)) and \
            all(abs(v / (b * rms) - 1) < 0.01 for v in p["offsets"])
    for k in range(1, 6):
        perm = np.arange(S)
        perm[[0, k]] = perm[[k, 0]]
        yield "permutation", r[..., perm], lambda p, perm=perm: p.get("perm") == perm.tolist()
    for s in (1, -1, 2, -2):
        d = np.zeros_like(r)
        if s > 0:
            d[..., : S - s] = r[..., s:]
        else:
            d[..., -s:] = r[..., : S + s]
        yield "shift", d, lambda p, s=s: p == {"axis": last, "by": s}
    for q in (0.6, 0.8, 0.9, 0.97, 0.995):
        hi = float(np.quantile(r, q))
        yield "saturation", np.minimum(r, hi), lambda p, hi=hi: math.isclose(p["hi"], hi, rel_tol=1e-6)
    for k in (1, 3, 10):
        d = r.copy()
        d.ravel()[: k] = np.inf
        yield "non-finite", d, lambda p, k=k: p["n_inf"] == k
    for j in range(3):
        d = r.copy()
        d[..., j] = 0
        yield "masked region", d, lambda p, j=j: p.get("slices") == [j] and p.get("axis") == last
    yield "sign/swap", -r, lambda p: p == {"factor": -1.0}
    yield "sign/swap", np.concatenate([-r[..., S // 2:], r[..., : S // 2]], -1), lambda p: p["signs"] == [-1, 1]


# ------------------------------------------------------------------------------------------------ in the diff's outputs

def test_fault_in_every_output(tmp_path, capsys):
    """A reference run with one tap's channel 5 scaled x1.03 (tests/diff/faults.py) diffed by the CLI: the
    terminal line under the first divergence, --json's fault object (read back by --rejudge), the HTML scatter and
    per-slice bars, replay's row and explain's line all name 'gain' on channel 5."""
    import json

    import faults as F

    from refimpl.bundle import read_bundle
    from refimpl.cli import main
    from refimpl.diff import explain, load_metrics, read_dump, replay
    from refimpl.golden import write_golden

    model, _ = F.model_and_arrays("tiny-qwen3", vocab_size=2048, eos_token_id=2000)
    params = {"ar": 4, "cl": 16, "mask_floor": -1000.0}
    prompt = [97, 11, 1879, 13, 42, 7, 99]
    bundle = read_bundle(write_golden(tmp_path / "golden", model, prompt, source="tiny-qwen3", convention="genie",
                                      params=params, decode_steps=1, taps="."))
    name = "model.layers.1.post_attention_layernorm"

    def wrong(x):
        x = x.copy()
        x[..., 5] *= np.float32(1.03)
        return x
    dump = F.device_dump(model, prompt, params, 1, tmp_path / "dump", F.corrupt_tap(name, wrong))
    args = ["diff", str(bundle.path), str(dump), "-q", "--json", str(tmp_path / "m.json"), "--html",
            str(tmp_path / "r.html")]
    assert main(args) == 1
    out = capsys.readouterr().out
    line = out.split("first divergence, step 0:")[1].splitlines()[1]
    assert line.startswith("  fault: gain: slices 5 of axis ") and "scaled by 1.03" in line, out
    saved = json.loads((tmp_path / "m.json").read_text())
    fault = next(r["fault"] for r in saved["results"] if r["key"] == f"0/tap/{name}")
    assert fault["class"] == "gain" and fault["params"]["slices"] == [5] and fault["residual_after"] < 1e-8
    assert abs(fault["params"]["factors"][0] - 1.03) < 1e-4 and fault["criterion"].startswith("residual NMSE")
    assert next(r for r in load_metrics(tmp_path / "m.json").results if r.fault).fault == fault
    for bad in ({**fault, "class": "gremlins"}, {**fault, "residual_after": "low"}, {"class": "gain"}):
        broken = json.loads((tmp_path / "m.json").read_text())
        next(r for r in broken["results"] if r["fault"])["fault"] = bad
        (tmp_path / "bad.json").write_text(json.dumps(broken))
        with pytest.raises(InputError, match="fault"):
            load_metrics(tmp_path / "bad.json")
    page = (tmp_path / "r.html").read_text()
    assert "fault: <b>gain: slices 5" in page and "Device vs reference at the first divergence: gain" in page
    assert "Per-slice gain along axis" in page
    rows = replay(bundle, read_dump(dump, bundle), model, layer=1, step=0)
    assert [(r.name, r.fault["class"], r.fault["params"]["slices"]) for r in rows if r.adds_error] == \
        [(name, "gain", [5])]
    text = explain(bundle, model, f"{name}[0,3,5]", step=0, device={name: read_dump(dump, bundle).items[
        f"0/tap/{name}"].array.reshape(bundle.manifest["tensors"][f"0/tap/{name}"]["shape"])})
    assert "fault class of the whole tensor: gain: slices 5 of axis" in text, text


def test_assert_close_names_the_class():
    from refimpl.testing import assert_close
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    d = x.copy()
    d[:, 8] = 0
    with pytest.raises(AssertionError, match="fault class: masked region: zero where the reference is not in 4 "
                                             "elements \\(slices 8 of axis 1\\)"):
        assert_close(d, x.astype(np.float64), dtype="float32")
    with pytest.raises(AssertionError, match="fault class: sign/swap"):
        assert_close(-x.astype(np.float16), x, dtype="float16")


@pytest.mark.parametrize("rot", [32, 16])
def test_rope_conventions_from_the_golden_pair(rot):
    """rope_alternatives recovers cos / sin from RoPE's input and half-split output (refimpl's kernel) and makes the
    interleaved and the sign-flipped conventions of them (written here from their definitions), to float32 rounding."""
    from refimpl.diff.classify import rope_alternatives
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, 4, 32)).astype(np.float32)                        # [B, T, H, D]
    ang = np.arange(5)[:, None] * 10000.0 ** (-np.arange(rot // 2) / (rot // 2))     # [T, rot/2]
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    h = rot // 2
    half = x.astype(np.float64).copy()
    half[..., :h], half[..., h:rot] = x[..., :h] * c - x[..., h:rot] * s, x[..., h:rot] * c + x[..., :h] * s
    inter = x.astype(np.float64).copy()
    inter[..., 0:rot:2] = x[..., 0:rot:2] * c - x[..., 1:rot:2] * s
    inter[..., 1:rot:2] = x[..., 1:rot:2] * c + x[..., 0:rot:2] * s
    alts = rope_alternatives(x, half.astype(np.float32), rot)
    got = alts["permutation: RoPE over interleaved pairs (2i, 2i+1) instead of half-split (i, i + rot/2)"]
    assert np.max(np.abs(got - inter)) < 1e-5
    f = classify(half.astype(np.float32), inter.astype(np.float32), alternatives=alts)
    assert f.kind == "permutation" and f.summary.startswith("RoPE over interleaved pairs"), f
    flipped = x.astype(np.float64).copy()
    flipped[..., :h], flipped[..., h:rot] = x[..., :h] * c + x[..., h:rot] * s, x[..., h:rot] * c - x[..., :h] * s
    f = classify(half.astype(np.float32), flipped.astype(np.float32), alternatives=alts)
    assert f.kind == "sign/swap" and "sine's sign flipped" in f.summary, f


QEFF_FAULTS = {   # tap, wrong value, class, parameter check
    "gain channel 7": ("model.layers.1.post_attention_layernorm", lambda x: _scaled(x, 7, 1.05), "gain",
                       lambda p: p.get("slices") == [7] and abs(p["factors"][0] - 1.05) < 0.01),
    "heads 0 and 2 swapped": ("model.layers.3.self_attn.q_norm", lambda x: x[..., [2, 1, 0, 3], :], "permutation",
                              lambda p: p.get("cycles") == [[0, 2]]),
    "rows shifted": ("model.layers.1.input_layernorm", lambda x: np.concatenate([x[:, 1:], 0 * x[:, :1]], 1)
                     if x.shape[1] > 2 else x, "shift", lambda p: p.get("by") == 1),
    "clipped": ("model.layers.1.input_layernorm", lambda x: np.clip(x, -1.0, 1.0), "saturation",
                lambda p: p["hi"] == 1.0),
    "sign": ("model.layers.1.input_layernorm", lambda x: -x, "sign/swap", lambda p: abs(p["factor"] + 1) < 1e-3),
}


def _scaled(x, channel, c):
    x = x.copy()
    x[..., channel] *= np.float32(c)
    return x


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3.5", "tiny-qwen3-next"])
def test_fault_classes_on_the_qeff_convention(preset, tmp_path):
    """The QEfficient convention (its own I/O; the independent devices run hf and genie): refimpl with one tap
    corrupted as the device (tests/diff/faults.py), every architecture, the class named with its parameters."""
    import faults as F

    from refimpl.bundle import read_bundle
    from refimpl.diff import compare, read_dump
    from refimpl.golden import write_golden
    model, _ = F.model_and_arrays(preset, vocab_size=2048, eos_token_id=2000)
    params, prompt = {"seq_len": 4, "ctx_len": 16}, [97, 11, 1879, 13, 42, 7, 99]
    golden = read_bundle(write_golden(tmp_path / "golden", model, prompt, source="x", convention="qeff",
                                      params=params, decode_steps=1, taps=r"layers\.[13]\."))
    for name, (tap, fn, kind, check) in QEFF_FAULTS.items():
        dump = F.device_dump(model, prompt, params, 1, tmp_path / name.replace(" ", "_"), F.corrupt_tap(tap, fn),
                             convention="qeff")
        report = compare(golden, read_dump(dump, golden))
        key = report.first_divergence[0]
        assert key == f"0/tap/{tap}", (name, key)
        fault = next(r.fault for r in report.results if r.key == key)
        assert fault["class"] == kind and check(fault["params"]), (name, fault)
