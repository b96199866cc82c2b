"""The fault classes (refimpl.diff.classify) on a real quantised device: AIMET's QuantizationSimModel
(tests/aimet_oracle.py) judged three-way against refimpl's quantised golden (its encodings). Every tensor of an
honest run is 'precision' (an integer tap at its encoding's grid: int8 / int16 at the encoding's scale); a wrong
per-channel weight scale (one output channel of a projection x1.02) is a gain of that channel, a wrong activation
zero point (the consumer reading the codes 3 steps off) an offset of 3 steps."""

import pytest

from aimet_oracle import GROUP, three_way_case

pytestmark = [pytest.mark.oracle, GROUP, pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

PLANTED = "model.layers.1.mlp.up_proj"          # [B, T, 40]: the per-channel weight scale's output
OFFSET_AT = "model.layers.1.post_attention_layernorm"


def classified(directory, arch, mix, fault=None):
    """(classes of every compared tensor {name: Fault}, the first divergence's Fault or None, tap encodings)."""
    from refimpl.bundle import read_bundle, valid_mask
    from refimpl.diff import make_policy
    from refimpl.diff.classify import classify, divergence_arrays, judged_floor
    from refimpl.diff.dump import read_dump
    from refimpl.diff.quantised import EXCESS, compare_three_way, decode_codes, tap_encodings
    case = three_way_case(arch, mix, directory, fault)
    float_bundle, quantised = read_bundle(case["float"]), read_bundle(case["quantised"])
    encodings = tap_encodings(quantised, case["encodings"])
    dump = read_dump(case["device"], quantised)
    decode_codes(dump, quantised, encodings)
    policy = make_policy({"ignore": ["^present"]})
    report, _ = compare_three_way(float_bundle, quantised, dump, policy)
    policy.three_way_k = EXCESS
    out = {}
    for r in report.results:
        arrays = divergence_arrays(quantised, dump, r) if r.metrics and r.metrics["n"] else None
        if arrays is None:
            continue
        golden, device, _ = arrays
        valid = valid_mask(golden.shape, quantised.manifest["tensors"][r.key]["valid"])
        enc = encodings.get(r.name)
        if enc is not None and enc.float_dtype is None and enc.scale.size == 1:   # an integer grid, per tensor
            out[r.name] = classify(golden, device, valid, f"int{enc.bitwidth}" if enc.bitwidth in (8, 16) else
                                   "int8", scale=float(enc.scale))
        else:                                   # a float tap: the bar the diff judged it by
            out[r.name] = classify(golden, device, valid, floor=judged_floor(r.metrics, policy.criteria(
                r.name, False, r.reference)), separation=1.0)
    key = next((k for _, k in sorted(report.first_divergence.items()) if k), None)
    first = next((r.fault for r in report.results if r.key == key), None) if key else None
    return out, first, encodings


@pytest.mark.parametrize("arch, mix", [("Qwen3", "W8A8"), ("Qwen3.5", "W8A16")])
def test_honest_quantsim_is_precision_on_every_tensor(arch, mix, tmp_path):
    out, first, encodings = classified(tmp_path, arch, mix)
    kinds = {}
    for name, f in out.items():
        kinds.setdefault(f.kind, []).append(name)
    assert set(kinds) == {"precision"}, {k: v[:4] for k, v in kinds.items()}
    assert first is None
    grids = sum(1 for n in out if n in encodings and encodings[n].float_dtype is None)
    assert grids > 20, grids                   # most taps judged on their integer grid


def test_wrong_per_channel_weight_scale_is_a_channel_gain(tmp_path):
    def scaled(a):
        a = a.copy()
        a[..., 7] *= 1.02
        return a
    _, first, _ = classified(tmp_path, "Qwen3", "W8A16", (PLANTED, scaled))
    assert first is not None and first["class"] == "gain", first
    assert first["params"].get("slices") == [7] and abs(first["params"]["factors"][0] / 1.02 - 1) < 0.01, first


def test_wrong_activation_offset_is_an_offset_of_three_steps(tmp_path):
    _, _, encodings = classified(tmp_path / "clean", "Qwen3", "W8A8")
    step = float(encodings[OFFSET_AT].scale)
    _, first, _ = classified(tmp_path / "faulty", "Qwen3", "W8A8", (OFFSET_AT, lambda a: a + 3 * step))
    assert first is not None and first["class"] == "offset", first
    assert "axis" not in first["params"] and abs(first["params"]["offset"] / (3 * step) - 1) < 0.01, first
