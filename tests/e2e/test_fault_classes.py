"""`refimpl diff` names the kind of fault at the first divergence, on independent devices (tests/e2e/devices.py):
every fault class planted into a device kernel's output (a module's forward hook: the device computes on from the
wrong value) at several magnitudes, across the architectures (presets) and conventions hf, genie and qeff
(FAULT_CLASSES: the class of each host / graph fault of test_independent_devices, checked there); the HTP simulator
with weight and host faults (HTP_FAULTS); honest reduced-precision runs give 'precision' on every tensor.

A case is right when the class and its parameters are (a factor within 1 %, the planted channels / heads / rows /
slots); 'unexplained' or 'precision' is allowed for the cases marked so below (a nonlinear fault no model is meant
to fit; the 'unexplained' count of the table); any other class is wrong and fails.

    python tests/e2e/test_fault_classes.py [DIR]    # the full table: architecture x convention x class x magnitude

The suite runs a rotation of it (each kind of planted fault once, over the architectures, conventions and
magnitudes). Devices are a
parameter: DEVICES holds one line per device."""

import functools
import math
import re
import sys
from pathlib import Path

import devices as D
import numpy as np
import pytest
from test_independent_devices import ARCHITECTURES, GENIE, STEPS, device_dump, first, judge
from test_independent_devices import cases as shared_cases

from refimpl.bundle import valid_mask
from refimpl.diff.classify import classify, divergence_arrays, judged_floor
from refimpl.diff.divergence import model_config
from refimpl.diff.dump import read_dump
from refimpl.diff.layouts import conv_kernel
from refimpl.diff.policy import make_policy

pytestmark = pytest.mark.oracle
cases = shared_cases          # the fixture: one golden and checkpoint per architecture, built once per module
torch = D.torch

# device name -> device_dump keyword arguments (and the conventions it runs)
DEVICES = {
    "transformers": ({"runtime": "transformers"}, ("hf", "genie", "qeff")),
    "onnxruntime": ({"runtime": "ort"}, ("genie",)),
    # Qualcomm's HTP simulator (tests/e2e/htp.py), float16, judged three-way against the htp-fp16 emulation
    "htp": ({"runtime": "htp", "precision": "htp-fp16"}, ("genie",)),
}
ATTN_LAYER = 3            # a full-attention layer of every preset (the hybrids' fourth)


def _channels(x, idx, fn):
    y = x.clone()
    y[..., idx] = fn(y[..., idx])
    return y


def _rows(x, fn):
    """fn applied along the token axis of a [B, T, C] output (prompt calls only: T > 2)."""
    return fn(x) if x.shape[-2] > 2 else x


def _shift_rows(x):
    y = torch.zeros_like(x)
    y[..., :-1, :] = x[..., 1:, :]            # device row t holds the reference's row t + 1
    return y


def _zero_row(x):
    y = x.clone()
    y[..., -2, :] = 0
    return y


def _inf(x):
    y = x.clone()
    y[..., -1, 5] = math.inf
    return y


def _clip(x, seen):
    hi = float(x.abs().max()) * 0.5
    seen.append(hi)
    return x.clamp(-hi, hi)


def _offset(x, b, seen):
    v = b * float(x.pow(2).mean().sqrt())
    seen.append(v)
    return _channels(x, slice(0, 16), lambda c: c + v)


def _swap_heads(x):                          # q_norm output [B, T, H, D]: heads 0 and 2 swapped
    return x[..., [2, 1, 0, 3], :]


def _halves(x):                              # rotate_half applied where it should not be: [-x2, x1]
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def planted_cases():
    """name -> (fault maker(seen) -> Fault, expected class, parameter check(params, seen, r) or None, magnitude)."""
    out = {}
    norm, post = "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm"
    q_norm = f"model.layers.{ATTN_LAYER}.self_attn.q_norm"
    for c in (0.97, 1.01, 1.3):
        out[f"gain whole x{c}"] = (lambda seen, c=c: D.Fault(module_output=(norm, lambda x: x * c))), "gain", \
            lambda p, seen, c=c: "axis" not in p and abs(p["factor"] / c - 1) < 0.01
        out[f"gain channel 7 x{c}"] = (lambda seen, c=c: D.Fault(module_output=(
            post, lambda x: _channels(x, [7], lambda v: v * c)))), "gain", \
            lambda p, seen, c=c: p.get("slices") == [7] and abs(p["factors"][0] / c - 1) < 0.01
        out[f"gain head 1 x{c}"] = (lambda seen, c=c: D.Fault(module_output=(
            q_norm, lambda x: _channels(x.transpose(-1, -2), [1], lambda v: v * c).transpose(-1, -2)))), "gain", \
            lambda p, seen, c=c: p.get("slices") == [1] and abs(p["factors"][0] / c - 1) < 0.01
    for b in (0.01, 0.1, 1.0):
        out[f"offset channels 0-15 +{b} rms"] = (lambda seen, b=b: D.Fault(module_output=(
            post, lambda x: _offset(x, b, seen)))), "offset", \
            lambda p, seen: p.get("slices") == list(range(16)) and \
            all(any(abs(o / v - 1) < 0.01 for v in seen) for o in p["offsets"])
    out["permutation heads 0 and 2"] = (lambda seen: D.Fault(module_output=(q_norm, _swap_heads))), "permutation", \
        lambda p, seen: p.get("cycles") == [[0, 2]]
    out["permutation channels 3 and 11"] = (lambda seen: D.Fault(module_output=(
        norm, lambda x: x[..., [11 if i == 3 else 3 if i == 11 else i for i in range(x.shape[-1])]]))), \
        "permutation", lambda p, seen: p.get("cycles") == [[3, 11]]
    out["shift rows by one"] = (lambda seen: D.Fault(module_output=(post, lambda x: _rows(x, _shift_rows)))), \
        "shift", lambda p, seen: p.get("by") == 1
    out["saturation at half the max"] = (lambda seen: D.Fault(module_output=(norm, lambda x: _clip(x, seen)))), \
        "saturation", lambda p, seen: any(math.isclose(p["hi"], v, rel_tol=1e-3) for v in seen)
    out["non-finite element"] = (lambda seen: D.Fault(module_output=(post, _inf))), "non-finite", \
        lambda p, seen: p["n_inf"] == 1
    out["masked region: a zeroed row"] = (lambda seen: D.Fault(module_output=(norm, lambda x: _rows(x, _zero_row)))), \
        "masked region", lambda p, seen: len(p.get("slices", [])) == 1
    out["sign flipped"] = (lambda seen: D.Fault(module_output=(norm, lambda x: -x))), "sign/swap", \
        lambda p, seen: abs(p.get("factor", 0) + 1) < 0.01 and "axis" not in p
    out["rotate_half applied"] = (lambda seen: D.Fault(module_output=(q_norm, _halves))), "sign/swap", \
        lambda p, seen: p.get("signs") == [-1, 1] and p.get("swapped")
    return out


PLANTED = planted_cases()
@functools.cache
def _hybrid_a_log(layer: int) -> np.ndarray:
    return D.small_preset(ARCHITECTURES["hybrid"])[1][f"model.layers.{layer}.linear_attn.A_log"].astype(np.float64)


# the class of each host / graph fault of test_independent_devices.FAULTS (checked there, on the same dumps), and
# its parameters; None: nonlinear in the planted parameter, no model is meant to fit ('unexplained' is right:
# a conv weight under a SiLU)
FAULT_CLASSES = {
    "norm weight (dense)": ("gain", lambda p, seen: abs(p.get("factor", 0) / 1.1 - 1) < 0.01),
    "k_norm weight (moe)": ("gain", lambda p, seen: abs(p.get("factor", 0) / 1.1 - 1) < 0.01),
    "gated norm weight (hybrid)": ("gain", lambda p, seen: abs(p.get("factor", 0) / 1.1 - 1) < 0.01),
    # g = -exp(A_log) softplus(.): A_log x1.2 scales head h's g by exp(0.2 A_log_h), a per-head gain
    "A_log (hybrid)": ("gain", lambda p, seen: p.get("slices") == [0, 1, 2, 3] and np.allclose(
        p["factors"], np.exp(0.2 * _hybrid_a_log(1)), rtol=0.01)),
    "conv weight (hybrid)": (None, None),
    "interleaved RoPE (dense)": ("permutation", lambda p, seen: "interleaved" in p.get("alternative", "")),
    "interleaved RoPE (hybrid)": ("permutation", lambda p, seen: "interleaved" in p.get("alternative", "")),
    "mask floor -50 (dense)": ("masked region", lambda p, seen: p.get("lo") == -50.0),
    "KV window shifted at a decode step (moe)": ("shift", lambda p, seen: p.get("by") == 1),
    "conv state not shifted (hybrid)": ("stale state", lambda p, seen: p["equals"] == "the previous step's value"),
    "recurrent state not carried (hybrid)": ("stale state",
                                             lambda p, seen: p["equals"] == "the initial (zero) state"),
    "recurrent state not carried (next, hf)": ("stale state",
                                               lambda p, seen: p["equals"] == "the initial (zero) state"),
    "fp16 overflow in a down projection (hybrid)": ("non-finite", lambda p, seen: p["n_inf"] > 0),
    "K written untransposed (dense)": ("permutation", lambda p, seen: p.get("layout") == "bytes"),
}


# host faults of the qeff convention: (architecture, Fault, expected class, parameter check)
QEFF_FAULT_CLASSES = {
    "recurrent state not carried (hybrid, qeff)": ("hybrid", D.Fault(recurrent_not_carried_step=2), "stale state",
                                                   lambda p, seen: p["equals"] == "the initial (zero) state"),
}


def verdict(report, expected, check, seen) -> tuple[str, dict | None]:
    """right | unexplained (also 'precision' or nothing classified) | wrong, and the fault of the earliest first
    divergence."""
    key = next((k for _, k in sorted(report.first_divergence.items()) if k), None)
    fault = next((r.fault for r in report.results if r.key == key), None) if key else None
    if fault is None or fault["class"] in ("unexplained", "precision"):
        return "unexplained", fault
    if expected is not None and fault["class"] == expected and check(fault["params"], seen):
        return "right", fault
    return "wrong", fault


def run_case(cases_fixture, tmp_path, arch, convention, device, fault, params=None, steps=STEPS):
    """(report, golden, dump path); a device with a precision is judged three-way against its emulation."""
    case = cases_fixture(arch)
    bundle = case.golden(convention, params=params, steps=steps)
    kwargs = dict(DEVICES[device][0])
    precision = kwargs.pop("precision", None)
    dump = device_dump(case, bundle, tmp_path / "dump", fault, **kwargs)
    emulated = case.golden(convention, precision, params=params, steps=steps) if precision else None
    return judge(bundle, dump, "fp16" if precision else "fp32", emulated), bundle, dump


def rotation():
    """(architecture, convention, device, planted fault): each kind of planted fault once (its magnitudes taken in
    turn), rotating over the architectures and the conventions of the transformers device."""
    archs, kinds = list(ARCHITECTURES), {}
    for name in PLANTED:
        kinds.setdefault(re.sub(r" [x+][\d.]+( rms)?$", "", name), []).append(name)     # the name less its magnitude
    conventions = DEVICES["transformers"][1]
    return [(archs[i % len(archs)], conventions[(i // len(archs)) % len(conventions)], "transformers",
             names[i % len(names)]) for i, names in enumerate(kinds.values())]


def qeff_rotation():
    """(architecture, planted fault) for each class the rotation does not plant on the qeff convention: with it,
    every class of the other conventions on qeff too."""
    done = {PLANTED[name][1] for _, conv, _, name in rotation() if conv == "qeff"}
    archs, out = list(ARCHITECTURES), []
    for name, (_, expected, _) in PLANTED.items():
        if expected not in done:
            done.add(expected)
            out.append((archs[len(out) % len(archs)], name))
    return out


@pytest.mark.parametrize("arch,convention,device,name", rotation())
def test_planted_fault_class(arch, convention, device, name, cases, tmp_path):
    make, expected, check = PLANTED[name]
    seen = []
    report, _, _ = run_case(cases, tmp_path, arch, convention, device, make(seen))
    v, fault = verdict(report, expected, check, seen)
    assert v == "right", (v, fault)


@pytest.mark.parametrize("arch,name", qeff_rotation())
def test_planted_fault_class_on_qeff(arch, name, cases, tmp_path):
    make, expected, check = PLANTED[name]
    seen = []
    report, _, _ = run_case(cases, tmp_path, arch, "qeff", "transformers", make(seen))
    v, fault = verdict(report, expected, check, seen)
    assert v == "right", (v, fault)


def test_qeff_state_not_carried_is_stale_state(cases, tmp_path):
    """The QEfficient host feeding zeros instead of recurrent_state.0_RetainedState into a decode call."""
    report, _, _ = run_case(cases, tmp_path, "hybrid", "qeff", "transformers", D.Fault(recurrent_not_carried_step=2))
    expected, check = QEFF_FAULT_CLASSES["recurrent state not carried (hybrid, qeff)"][2:]
    assert first(report) == (2, "recurrent_state.0"), first(report)
    assert verdict(report, expected, check, [])[0] == "right"


def test_onnx_runtime_device_fault_class(cases, tmp_path):
    """The same classification on ONNX Runtime (the hook exported into the graph; AR = 1 graphs, one export: a
    tensor of one token per call, so a single channel cannot be told from noise there, a head can)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    make, expected, check = PLANTED["permutation heads 0 and 2"]
    report, _, _ = run_case(cases, tmp_path, "hybrid", "genie", "onnxruntime", make([]), {**GENIE, "ar": 1})
    assert verdict(report, expected, check, [])[0] == "right"


# ------------------------------------------------------------------------------------------------ the HTP

# The HTP device (DEVICES["htp"]) on the dense preset's prompt call (genie AR 8): the session's HTP case of
# tests/e2e/htp_runs.py (`htp_cases`, shared with test_htp: one float16 export, each graph compiled once, a run
# both modules judge run once); weight faults are planted in the exported graph's initializers and host faults in
# the host loop. Dense only as written: the hybrids' norms scale by 1 + w, where a weight x1.05 or x-1 is a
# per-channel gain (1 + c w) / (1 + w).
HTP_FAULTS = {
    # name: (Fault, expected class, parameter check)
    "norm gain x1.05": (D.Fault(scale_weight=("model.layers.1.input_layernorm.weight", 1.05)), "gain",
                        lambda p, seen: "axis" not in p and abs(p["factor"] / 1.05 - 1) < 0.01),
    "o_proj rows 3 and 11 swapped": (D.Fault(swap_rows=("model.layers.2.self_attn.o_proj.weight", 3, 11)),
                                     "permutation", lambda p, seen: p.get("cycles") == [[3, 11]]),
    "norm sign flipped": (D.Fault(scale_weight=("model.layers.1.post_attention_layernorm.weight", -1.0)),
                          "sign/swap", lambda p, seen: abs(p.get("factor", 0) + 1) < 0.01 and "axis" not in p),
    "mask floor -50": (D.Fault(mask_floor=-50.0), "masked region", lambda p, seen: p.get("lo") == -50.0),
}
HTP_STEPS = {"norm gain x1.05": 2}   # test_htp runs this one with its decode calls: the same run, judged here too


@pytest.mark.device_matrix   # every tensor classified (~14 s on the HTP worker): make test-devices; the honest run's
@pytest.mark.xdist_group("htp")   # verdict itself is in make test (test_htp)
def test_htp_honest_run_is_precision_only(htp_cases):
    """test_htp's honest dense run (prompt and decode calls), every tensor classified."""
    case = htp_cases("dense")
    dump = case.dump()
    report = case.judge(dump)
    assert report.exit_code == 0, [(r.key, r.failures) for r in report.failed][:3]
    counts = honest_classes(report, case.golden(), dump, "fp16")
    assert set(counts) == {"precision"} and counts["precision"] > 250, counts     # 91 tensors x 3 calls judged


@pytest.mark.xdist_group("htp")
@pytest.mark.parametrize("name", list(HTP_FAULTS))
def test_htp_planted_fault_class(name, htp_cases):
    fault, expected, check = HTP_FAULTS[name]
    case, steps = htp_cases("dense"), HTP_STEPS.get(name, 0)
    report = case.judge(case.dump(fault, steps=steps), steps=steps)
    v, f = verdict(report, expected, check, [])
    assert v == "right", (v, f)


def honest_classes(report, bundle, dump, dtype, bar: bool = True) -> dict:
    """{class: count} over every compared float tensor of an honest run (dump: its directory), classified at the
    bar that judged it (bar), else at the plain precision floor of dtype (refimpl.diff.classify's default)."""
    policy = make_policy({"layouts": {".": "hf-hooks"}}, dtype)
    kernel = conv_kernel(model_config(bundle.manifest["model"]["config"]))
    dump = read_dump(dump, bundle)
    counts = {}
    for r in report.results:
        arrays = divergence_arrays(bundle, dump, r, kernel) if r.metrics and r.metrics["n"] else None
        if arrays is None:
            continue
        golden, device, _ = arrays
        f = classify(golden, device, valid_mask(golden.shape, bundle.manifest["tensors"][r.key]["valid"]), dtype,
                     floor=judged_floor(r.metrics, policy.criteria(r.name, False, r.reference)) if bar else None,
                     separation=1.0 if bar and r.reference else None)
        counts[f.kind] = counts.get(f.kind, 0) + 1
    return counts


def test_honest_reduced_precision_runs_are_precision_only(cases, tmp_path):
    """transformers in bfloat16 (three-way against refimpl's bf16 emulation): every tensor 'precision'."""
    case = cases("hybrid")
    golden, emulated = case.golden("hf"), case.golden("hf", "bf16")
    dump = device_dump(case, golden, tmp_path / "honest", dtype="bfloat16")
    report = judge(golden, dump, "bf16", emulated)
    counts = honest_classes(report, golden, dump, "bf16")
    assert set(counts) == {"precision"} and counts["precision"] > 100, counts
    # at bf16's plain floor (no emulation): a tensor above it is 'unexplained', never a fault
    assert set(honest_classes(report, golden, dump, "bf16", bar=False)) <= {"precision", "unexplained"}


def main(root: Path, conventions=None) -> None:
    """The full table: every planted fault x architecture x convention on transformers (and ONNX Runtime on a
    few), the existing faults, honest bf16 / fp16 runs. conventions: only these (the transformers part only)."""
    import tempfile
    root.mkdir(parents=True, exist_ok=True)
    built = {}

    def get(arch):
        if arch not in built:
            from test_independent_devices import Case
            r = root / arch
            config, arrays = D.small_preset(ARCHITECTURES[arch])
            built[arch] = Case(config, arrays, D.hf_checkpoint(config, arrays, r / "checkpoint"), r)
        return built[arch]
    table, rows = {}, []

    def count(kind, v, what, fault):
        table.setdefault(kind, {"right": 0, "unexplained": 0, "wrong": 0})[v] += 1
        rows.append((what, v, fault and f"{fault['class']}: {fault['summary']}"))
        print(f"{v:12s} {what:70s} {fault and fault['class']}: {fault and fault['summary'][:90]}", flush=True)
    for arch in ARCHITECTURES:
        for conv in conventions or DEVICES["transformers"][1]:
            for name, (make, expected, check) in PLANTED.items():
                seen = []
                with tempfile.TemporaryDirectory(dir=root) as t:
                    report, _, _ = run_case(get, Path(t), arch, conv, "transformers", make(seen))
                count(expected, *verdict(report, expected, check, seen)[:1], f"{arch} {conv} {name}",
                      verdict(report, expected, check, seen)[1])
    for name, (arch, fault, expected, check) in QEFF_FAULT_CLASSES.items():
        if "qeff" in (conventions or DEVICES["transformers"][1]):
            with tempfile.TemporaryDirectory(dir=root) as t:
                report, _, _ = run_case(get, Path(t), arch, "qeff", "transformers", fault)
            v, f = verdict(report, expected, check, [])
            count(expected, v, f"existing: {name}", f)
    if conventions:
        return summary(table)
    from test_independent_devices import FAULTS
    for name, (arch, conv, fault, *_) in FAULTS.items():
        expected, check = FAULT_CLASSES[name]
        with tempfile.TemporaryDirectory(dir=root) as t:
            report, _, _ = run_case(get, Path(t), arch, conv, "transformers", fault)
        v, f = verdict(report, expected, check, [])
        count(expected or "(none meant)", v, f"existing: {name}", f)
    for name in ("gain whole x1.01", "gain head 1 x0.97", "permutation heads 0 and 2", "saturation at half the max",
                 "sign flipped", "rotate_half applied"):   # AR = 1: one token per call (no per-channel fit)
        make, expected, check = PLANTED[name]
        seen = []
        with tempfile.TemporaryDirectory(dir=root) as t:
            report, _, _ = run_case(get, Path(t), "hybrid", "genie", "onnxruntime", make(seen), {**GENIE, "ar": 1})
        v, f = verdict(report, expected, check, seen)
        count(expected, v, f"onnxruntime hybrid genie {name}", f)
    summary(table)


def summary(table: dict) -> None:
    print("\nclass -> cases -> right / unexplained / wrong")
    for kind, t in table.items():
        print(f"{kind:16s} {sum(t.values()):4d}  {t['right']:4d} / {t['unexplained']:4d} / {t['wrong']:4d}")
    total = {v: sum(t[v] for t in table.values()) for v in ("right", "unexplained", "wrong")}
    print(f"{'total':16s} {sum(total.values()):4d}  {total['right']:4d} / {total['unexplained']:4d} / "
          f"{total['wrong']:4d}")


def honest(root: Path, conventions=("hf", "genie", "qeff")) -> None:
    """Every compared tensor of honest runs classified: float32 (every architecture and convention), transformers
    bfloat16 three-way (every architecture and convention), ONNX Runtime float16 three-way (hybrid, genie AR 1)."""
    from test_independent_devices import Case
    root.mkdir(parents=True, exist_ok=True)
    total = {}
    for arch in ARCHITECTURES:
        config, arrays = D.small_preset(ARCHITECTURES[arch])
        case = Case(config, arrays, D.hf_checkpoint(config, arrays, root / arch / "checkpoint"), root / arch)
        (root / arch).mkdir(exist_ok=True)
        runs = [(conv, dtype, "transformers", None) for conv in conventions for dtype in ("float32", "bfloat16")]
        if arch == "hybrid" and "genie" in conventions:
            runs.append(("genie", "float16", "ort", {**GENIE, "ar": 1}))
        for i, (conv, dtype, runtime, params) in enumerate(runs):
            golden = case.golden(conv, params=params)
            precision = {"float32": None, "bfloat16": "bf16", "float16": "fp16"}[dtype]
            emulated = case.golden(conv, precision, params=params) if precision else None
            dump = device_dump(case, golden, root / arch / f"dump-{i}", dtype=dtype, runtime=runtime)
            short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
            report = judge(golden, dump, short, emulated)
            counts = honest_classes(report, golden, dump, short)
            plain = honest_classes(report, golden, dump, short, bar=False)
            print(f"honest {arch} {conv} {runtime} {dtype}: at the diff's bar {counts}; at the {short} floor "
                  f"{plain}", flush=True)
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
    print(f"honest runs, every tensor: {total}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--honest"]:
        honest(Path(sys.argv[3]), sys.argv[2].split(",")) if len(sys.argv) > 3 else honest(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["--conventions"]:          # --conventions qeff[,hf,...] DIR
        main(Path(sys.argv[3]), sys.argv[2].split(","))
    else:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__import__("tempfile").mkdtemp()))
