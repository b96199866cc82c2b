"""Per-channel judgement (refimpl/diff/channels.py) and the diff fixes of issue 25: --emulated takes its manifest's
dtype, hooked block outputs that are taps are matched (a second file of one tensor is a duplicate, not unknown),
replay --json, each tensor's bar in diff --json."""

import json

import numpy as np
import pytest

from refimpl.bundle import read_bundle
from refimpl.cli import main
from refimpl.diff import channels as C
from refimpl.diff.channels import channel_bar, channel_scores, chi2_quantile, f_quantile, q_factor
from refimpl.diff.dump import read_dump
from refimpl.diff.hooks import rename
from refimpl.diff.policy import judge, make_policy
from refimpl.diff.saved import load_metrics, rejudge
from refimpl.errors import InputError

RNG = np.random.default_rng(5)


def test_chi2_quantiles_and_the_channel_factor():
    assert chi2_quantile(1, 0.05) == pytest.approx(3.8415, rel=1e-4)      # tables: chi2_1 at 95 %
    assert chi2_quantile(10, 0.001) == pytest.approx(29.588, rel=1e-4)    # chi2_10 at 99.9 %
    assert q_factor(7, 64) == pytest.approx(chi2_quantile(7, 1e-3 / 64) / 7)
    assert 4.8 < q_factor(7, 64) < 5 and 3.6 < q_factor(16, 1024) < 3.7 and 18.6 < q_factor(1, 64) < 18.8
    assert q_factor(1000, 64) < q_factor(100, 64) < q_factor(10, 64)      # more tokens, more evidence per channel
    assert f_quantile(1, 10, 0.05) == pytest.approx(4.9646, rel=1e-4)    # tables: F(1, 10) at 95 %
    assert f_quantile(5, 20, 0.01) == pytest.approx(4.1027, rel=1e-4)    # F(5, 20) at 99 %
    assert f_quantile(1, 10 ** 7, 1e-3 / 64) == pytest.approx(chi2_quantile(1, 1e-3 / 64), rel=1e-4)   # F(1, inf)


def _noisy(g, rel=1e-3):
    """A device with relative noise spread over every element (an honest fp16-like run)."""
    return g * (1 + rel * RNG.standard_normal(g.shape))


def test_one_scaled_channel_is_found_and_judged():
    g = RNG.standard_normal((1, 16, 256)) * RNG.uniform(0.3, 3, 256)      # [B, T, C], channels of unequal power
    mask = np.ones(g.shape, bool)
    honest = channel_scores(g, _noisy(g), mask, (0, 1))
    assert honest["count"] == 256 and honest["n"] == 16
    criteria = make_policy(None, "fp16").criteria("x.down_proj", False)
    device = _noisy(g)
    device[..., 100] *= 1.02                                              # one output channel 2 % off
    ch = channel_scores(g, device, mask, (0, 1))
    assert ch["worst"] == [100] and ch["gain"] == pytest.approx(0.02, abs=2e-3)
    m = {"n": g.size, "max_abs": 1.0, "n_nan": 0, "n_inf": 0, "nmse": 1e-5 / 2, "golden_max_abs": 9.0}
    assert judge({**m, "channels": honest}, None, criteria) == []
    failures = judge({**m, "channels": ch}, None, criteria)
    assert len(failures) == 1 and failures[0].startswith("channel [100] of 256: nmse") and "(gain +" in failures[0]
    # the channel fails only if it stands out of the rest AND fails the tensor's own bar
    assert channel_bar(ch, 1.0) == 1.0 and judge({**m, "channels": ch}, None, {**criteria, "max_nmse": 1.0}) == []
    assert judge({**m, "channels": ch}, None, {**criteria, "channels": False}) == []
    # a channel near 0 is judged at the tensor's scale: its noise is no fault
    g[..., 7] *= 1e-6
    quiet = _noisy(g)
    quiet[..., 7] += 1e-4 * RNG.standard_normal(16)
    assert judge({**m, "channels": channel_scores(g, quiet, mask, (0, 1))}, None, criteria) == []


def test_the_emulation_of_a_channel_explains_its_own_error():
    """Three-way: a channel the emulated run gets as wrong as the device is not a fault of the device."""
    g = RNG.standard_normal((1, 1, 64))
    device, emulation = g.copy(), g.copy()
    device[..., 3] += 0.5
    emulation[..., 3] -= 0.4
    mask = np.ones(g.shape, bool)
    criteria = {"max_nmse": 1e-5, "channels": True}
    m = {"n": 64, "max_abs": 0.5, "n_nan": 0, "n_inf": 0, "nmse": 1e-6}
    assert judge({**m, "channels": channel_scores(g, device, mask, (0, 1))}, None, criteria)
    assert judge({**m, "channels": channel_scores(g, device, mask, (0, 1), emulation)}, None, criteria) == []



def test_the_gain_test_finds_a_scaled_channel_the_nmse_test_misses():
    """Three-way, 7 tokens x 64 channels: the device's error half shared with the emulation (the arithmetic it
    predicts), half its own. One channel x1.02 stands out of the rest by nmse_c less than CONTRAST q (missed), but
    along its own values (z^2 ~ 0.02^2 n / 4e-6 = 700 against GAIN_CONTRAST q = 88) it is the gain test's; a
    token with 30 x the error on every channel (ill-conditioned for the whole tensor) is no gain of any channel."""
    g = RNG.standard_normal((1, 7, 64))
    shared, own = (0.002 * RNG.standard_normal(g.shape) for _ in range(2))
    emulation, honest = g + shared, g + shared + own
    mask, criteria = np.ones(g.shape, bool), {"max_nmse": 5e-5, "channels": True}
    faulty = honest.copy()
    faulty[..., 5] = honest[..., 5] + 0.02 * g[..., 5]                     # channel 5 x1.02
    for device, fails in ((honest, False), (faulty, True)):
        ch = channel_scores(g, device, mask, (0, 1), emulation)
        assert ch["contrast"] < C.CONTRAST                                   # the nmse test alone misses it
        failures = judge({"n": g.size, "nmse": 1e-5, "max_abs": 0.1, "n_nan": 0, "n_inf": 0, "channels": ch}, None,
                         criteria)
        assert bool(failures) == fails, failures
        if fails:
            assert failures == [f for f in failures if f.startswith("channel [5] of 64: gain +")], failures
            assert ch["gain_z2"] > C.GAIN_CONTRAST * ch["gain_q"] and ch["gain_offset"] == pytest.approx(0.02, abs=3e-3)
    ill = honest.copy()
    ill[:, 2], emulation_ill = g[:, 2] + 30 * (shared + own)[:, 2], emulation.copy()
    emulation_ill[:, 2] = g[:, 2] + 30 * (shared + 2 * RNG.standard_normal(g.shape) * 0.002)[:, 2]
    ch = channel_scores(g, ill, mask, (0, 1), emulation_ill)
    assert C.gain_failure(ch, 5e-5) is None, ch

def test_the_gain_test_takes_the_noise_scale_from_the_other_channels():
    """64 tokens x 64 channels, every channel's honest error partly along its own values (a small random gain per
    channel, as a recurrence carries one token's error into the next: z^2 ~ 37 on average where the per-token
    noise model says 1). Over the other channels' mean z^2 the honest tensor passes (the raw worst z^2 would not);
    one channel x1.02 stands out of that spread and is still the gain test's."""
    g = RNG.standard_normal((1, 64, 64))
    shared, own = (0.002 * RNG.standard_normal(g.shape) for _ in range(2))
    emulation = g + shared
    honest = g + shared + own + 0.0015 * RNG.standard_normal(64) * g                 # beta_c g, beta_c ~ N(0, 0.0015^2)
    faulty = honest.copy()
    faulty[..., 5] += 0.02 * g[..., 5]                                                # channel 5 x1.02
    mask = np.ones(g.shape, bool)
    ch = channel_scores(g, honest, mask, (0, 1), emulation)
    assert ch["gain_scale"] > 10 and C.gain_failure(ch, 5e-5) is None, ch
    assert ch["gain_z2"] * ch["gain_scale"] > C.GAIN_CONTRAST * ch["gain_q"]           # unscaled, it would fail
    ch = channel_scores(g, faulty, mask, (0, 1), emulation)
    failure = C.gain_failure(ch, 5e-5)
    assert failure is not None and failure.startswith("channel [5] of 64: gain +"), ch
    assert ch["gain_offset"] == pytest.approx(0.02, abs=3e-3)


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    root = tmp_path_factory.mktemp("channels")
    common = ["--model", "tiny-qwen3", "--input-ids", "1,2,3,4,5,6,7", "--convention", "genie", "--ar", "8", "--cl",
              "16", "--taps", r"layers\.0\.", "-q"]
    assert main(["golden", *common, "--out", str(root / "golden")]) == 0
    assert main(["golden", *common, "--precision", "fp16", "--follow", str(root / "golden"),
                 "--out", str(root / "fp16")]) == 0
    return root


def test_emulated_takes_its_manifests_dtype_and_json_carries_bars(goldens, tmp_path, capsys):
    golden, fp16 = goldens / "golden", goldens / "fp16"
    out = tmp_path / "m.json"
    assert main(["diff", str(golden), str(fp16), "--emulated", str(fp16), "--json", str(out), "-q"]) == 0
    saved = json.loads(out.read_text())
    assert saved["policy"]["dtype"] == "float16"
    floats = [r for r in saved["results"] if r["metrics"] and not r["metrics"].get("integer") and r["metrics"]["n"]]
    assert floats and all(r["bar"]["max_nmse"] >= 16 * 2.0 ** -22 / 3 for r in floats)   # k^2 x fp16 rounding
    assert sum("channel_max_nmse" in r["bar"] and r["metrics"]["channels"]["count"] > 1 for r in floats) > 10
    report = rejudge(load_metrics(out), make_policy(None, "fp16"))    # the bar judged again is recorded again
    assert all(r.bar for r in report.results if r.metrics)
    capsys.readouterr()
    assert main(["diff", str(golden), str(fp16), "--emulated", str(fp16), "--dtype", "fp32", "-q"]) == 2
    assert "computed at float16" in capsys.readouterr().err
    assert not (tmp_path / "n.json").exists()


def test_saved_channel_scores_are_checked(goldens, tmp_path):
    golden, fp16 = goldens / "golden", goldens / "fp16"
    out = tmp_path / "m.json"
    assert main(["diff", str(golden), str(fp16), "--emulated", str(fp16), "--json", str(out), "-q"]) == 0
    data = json.loads(out.read_text())
    r = next(r for r in data["results"] if (r["metrics"] or {}).get("channels"))
    r["metrics"]["channels"]["mse"] = "big"
    out.write_text(json.dumps(data))
    with pytest.raises(InputError, match="channels.mse"):
        load_metrics(out)


def test_replay_json(goldens, tmp_path, capsys):
    golden = goldens / "golden"
    out = tmp_path / "r.json"
    assert main(["replay", str(golden), str(golden), "--layer", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["layer"] == 0 and data["rows"] and not any(r["adds_error"] for r in data["rows"])
    assert {"total", "inherited", "added", "failures"} <= set(data["rows"][0])
    capsys.readouterr()
    assert main(["replay", str(golden), str(golden), "--layer", "0", "--json", str(tmp_path / "no" / "r.json")]) == 2


def test_hooked_block_outputs_are_matched(goldens, tmp_path):
    """A hook dump holds block outputs that are taps (`mlp` = down_proj in a dense MLP, `self_attn` = o_proj)
    and one tensor under two hooks (`o_proj.input` and `eager_attention_forward`): none is an unknown file."""
    assert rename("model.layers.2.mlp")[0] == [["model.layers.2.mlp"], ["model.layers.2.mlp.down_proj"]]
    assert rename("model.layers.2.self_attn")[0] == [["model.layers.2.self_attn.o_proj"]]
    assert rename("model.layers.2.linear_attn")[0] == [["model.layers.2.linear_attn.out_proj"]]
    assert rename("model.layers.2.mlp.shared_expert")[0] == [["model.layers.2.mlp.shared_expert.down_proj"]]
    bundle = read_bundle(goldens / "golden")
    d = tmp_path / "dump" / "steps" / "0" / "taps"
    d.mkdir(parents=True)
    L = "model.layers.0"
    files = {f"{L}.mlp": "mlp.down_proj", f"{L}.self_attn": "self_attn.o_proj",
             f"{L}.self_attn.o_proj.input": "self_attn.attn_output",
             f"{L}.self_attn.eager_attention_forward": "self_attn.attn_output",
             f"{L}.self_attn.o_proj": "self_attn.o_proj"}
    for name, tap in files.items():
        np.save(d / f"{name}.npy", bundle.tensor(0, "tap", f"{L}.{tap}"))
    dump = read_dump(tmp_path / "dump", bundle)
    assert dump.unknown == []
    assert set(dump.items) == {f"0/tap/{L}.{t}" for t in ("mlp.down_proj", "self_attn.o_proj", "self_attn.attn_output")}
    assert dump.items[f"0/tap/{L}.self_attn.o_proj"].source.endswith("self_attn.o_proj.npy")   # the tap's own name
    assert len(dump.duplicates) == 2
