"""refimpl with AIMET encodings against AIMET's own QuantizationSimModel (aimet-torch, the [aimet] extra; skipped
where it is not installed).

For each tiny random Qwen3 / Qwen3-MoE / Qwen3.5 (and Qwen3.5-MoE) model and each bit-width mix, QuantSim is built
(post_training_tf, AIMET's default config), calibrated on four 16-token sequences, and its encodings saved as
aimet-torch writes them; refimpl loads the saved checkpoint with that file and runs the same 4 x 48 tokens.

- placement: refimpl puts a quantiser exactly where QuantSim has one (module, input / output, index), nothing
  unplaced;
- weights: QuantSim's quantise-dequantised parameters and refimpl's weights are bit-identical;
- arithmetic: refimpl's quantiser on QuantSim's own quantiser inputs gives QuantSim's outputs bit for bit;
- codes: with every quantised module's inputs and outputs set to QuantSim's (teacher forcing), each quantiser's
  codes are refimpl's; a code that differs is one step off, and only where the two float32 values in front of the
  quantiser (refimpl's op and torch's, summed in other orders) are within 1 % of a step of each other, i.e.
  straddle a rounding boundary; over all quantisers >= 99.9 % are identical;
- logits: max |refimpl - QuantSim| <= 1 % of max |float model - QuantSim|, free running, where refimpl continues
  with QuantSim's code at each such rounding-boundary straddle (one 8-bit code apart moves the logits by ~2 % of
  the quantisation gap: a float-order accident, not a placement or arithmetic difference, which would not be
  one step at a boundary). MoE routers: quantised router logits tie, and torch.topk breaks an exact tie at the
  k-th place in its own partition order where refimpl takes the lower expert id (ONNX TopK); those tokens are
  routed as QuantSim routed them for this bar, and tokens only route differently where QuantSim's logits tie.
  The raw free-running numbers are in the closing note of issue 20 (tests/aimet_oracle.measure returns them).
"""

import pytest

from aimet_oracle import GROUP, MIXES, measure

pytestmark = [pytest.mark.oracle, GROUP, pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

CASES = [(arch, mix) for arch in ("Qwen3", "Qwen3-MoE", "Qwen3.5") for mix in MIXES] + [("Qwen3.5-MoE", "W8A16")]


@pytest.mark.parametrize("arch, mix", CASES)
def test_refimpl_with_aimet_encodings_reproduces_quantsim(arch, mix, tmp_path):
    m = measure(arch, mix, tmp_path)
    assert m["quantisers_refimpl"] == m["quantisers_quantsim"] and not m["unplaced"]
    assert m["weights_differing"] == 0
    assert m["arithmetic_differences"] == 0
    rows = m["codes"].values()
    for key, row in m["codes"].items():
        forced = row["forced"]
        assert forced["max_step"] <= 1, key
        assert forced.get("max_float_gap_steps", 0) < 0.01, key
    identical = sum(r["forced"]["identical"] * r["elements"] for r in rows) / sum(r["elements"] for r in rows)
    assert identical >= 0.999
    assert m["max_refimpl_vs_quantsim_aligned"] <= 0.01 * m["max_float_vs_quantsim"]
    assert m.get("first_router_untied_differences", 0) == 0    # the first router differs only at QuantSim's ties


def _channel_scaled(a):
    """One output channel 2 % too large: a wrong per-channel scale, on top of the quantisation."""
    a = a.copy()
    a[..., 7] *= 1.02
    return a


@pytest.mark.parametrize("arch, mix, planted", [("Qwen3", "W8A16", "model.layers.1.mlp.up_proj"),
                                                ("Qwen3.5", "W4A16", "model.layers.0.linear_attn.in_proj_z")])
def test_three_way_diff_of_quantsim_explains_it_and_finds_a_planted_fault(arch, mix, planted, tmp_path):
    """QuantSim as the device: every dumped tensor is explained by quantisation (its distance to the quantised
    golden far below quantisation's own distance to the float golden), half of them read as integer codes; the
    same run with one fault planted is flagged at the planted tap first."""
    from aimet_oracle import three_way_case
    from refimpl.bundle import read_bundle
    from refimpl.diff import make_policy
    from refimpl.diff.dump import read_dump
    from refimpl.diff.quantised import compare_three_way, decode_codes, tap_encodings
    policy = make_policy({"ignore": ["^present"]})   # the KV outputs: QuantSim's run keeps no cache to dump
    for fault in (None, (planted, _channel_scaled)):
        case = three_way_case(arch, mix, tmp_path / ("faulty" if fault else "clean"), fault)
        float_bundle, quantised = read_bundle(case["float"]), read_bundle(case["quantised"])
        dump = read_dump(case["device"], quantised)
        assert decode_codes(dump, quantised, tap_encodings(quantised, case["encodings"]))
        report, rows = compare_three_way(float_bundle, quantised, dump, policy)
        assert len(rows) > 20 and not dump.unknown
        if fault is None:
            assert not report.failed, [(r.name, r.failures) for r in report.failed]
            assert max(r.excess for r in rows) < 0.1 * 0.01          # QuantSim: < 1e-3 of quantisation's error
        else:
            assert report.first_divergence[0] == f"0/tap/{planted}"
