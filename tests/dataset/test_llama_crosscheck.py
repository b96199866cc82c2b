"""The whole loop against llama.cpp: refimpl's reference of the hidden-256 Qwen3 (F32) against llama.cpp running
its Q8_0 / Q4_0 files, on the same windows. compare-logits, given the logits llama.cpp produced (llama-cpp-python,
logits_all), reports the statistics `llama-perplexity --kl-divergence` printed for the same pair (reading refimpl's
exported base file). Fixtures and provenance: tests/fixtures/dataset/make_fixtures.py."""

import json
from pathlib import Path

import numpy as np
import pytest

import gguf_cases
from refimpl.dataset import compare_logits, cut, open_reference, write_reference
from refimpl.dataset.reference import Job
from refimpl.precision import Policy

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dataset"
LLAMA = json.loads((FIXTURES / "llama_perplexity.json").read_text())
PRINTED = 5e-7          # llama-perplexity prints 6 decimals


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("crosscheck")
    gguf_cases.write_checkpoint("qwen3-h256", root / "qwen3-h256")
    ids = np.random.default_rng(LLAMA["seed"]).integers(0, 300, LLAMA["ctx"] * LLAMA["windows"]).tolist()
    windows = cut([ids], LLAMA["ctx"])
    job = Job(str(root / "qwen3-h256"), Policy(), first=windows.first, scored=windows.scored)
    write_reference(root / "ref", job, windows, {"stride": None})
    ref = open_reference(root / "ref")
    logits = np.load(FIXTURES / "llama_logits.npz")
    for q in ("q8_0", "q4_0"):
        np.savez(root / f"{q}.npz", **{k[len(q) + 1:]: logits[k] for k in logits.files if k.startswith(q + "/")})
    return ref, root


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_matches_llama_perplexity(reference, quant):
    ref, root = reference
    printed = LLAMA[quant]["statistics"]
    report = compare_logits(ref, root / f"{quant}.npz")
    bound_mean, bound_max = report["kld_bound"]["mean"], report["kld_bound"]["max"]
    # 1. compare-logits' second column, llama.cpp's definition (16-bit base rows not renormalised, entries at or
    #    below -16 nats left out, float32 per-token values), reproduces every statistic llama-perplexity printed
    #    for the same pair to its printed digits (6 decimals; Δp, RMS Δp and same top p: 3 decimals of a percent)
    ll = report["llama_cpp"]
    for key, (value, _) in printed.items():
        a, _, b = key.partition("/")
        unit = 5e-6 if a in ("p_diff", "rms_p_diff", "same_top") else PRINTED
        size = printed["ppl"][0] if a == "ppl_difference" else abs(value)     # a difference of two PPLs
        assert abs(ll[a][b or "value"] - value) <= unit + 1e-7 * size, (key, ll[a][b or "value"], value)
    # 2. refimpl's statistics (exact NLL, renormalised KLD over every entry) agree with llama-perplexity's within
    #    the compact form's stated bound: the mean within the mean bound, order statistics within the largest
    for key in ("mean", "median", "p90", "p99", "p99.9", "max"):
        tol = (bound_mean if key == "mean" else bound_max) + PRINTED
        assert abs(report["kld"][key] - printed[f"kld/{key}"][0]) <= tol, (key, report["kld"][key], tol)
    assert len(report["kld_values"]) == ref.count * ref.scored
    assert report["ppl"]["value"] == pytest.approx(printed["ppl"][0], rel=2e-6)                  # the same logits
    h = max(float(ref.window(k)["scale"].max()) for k in range(ref.count))
    assert report["ppl_reference"]["value"] == pytest.approx(printed["ppl_reference"][0], rel=h / 2 + 2e-6)
    assert report["same_top"]["value"] == pytest.approx(printed["same_top"][0], abs=1 / report["tokens"] + 5e-6)
    assert report["rms_p_diff"]["value"] == pytest.approx(printed["rms_p_diff"][0], abs=5e-5 + h / 2)
