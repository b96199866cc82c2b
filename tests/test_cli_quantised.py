"""Quantised goldens and the three-way diff from the command line (no AIMET needed: the encodings file is written
here; tests/test_aimet.py runs the same path with AIMET's own files and QuantSim as the device)."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import refimpl
from refimpl.bundle import read_bundle
from refimpl.cli import main

IDS = "5,6,7,8"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """tiny-qwen3's float golden, an encodings file quantising every module's output (16 bit) and input_layernorm's
    consumers' inputs (8 bit), and the quantised golden with its codes."""
    d = tmp_path_factory.mktemp("quantised")
    model = refimpl.load("tiny-qwen3")
    with refimpl.trace() as tr:
        model.forward(np.array([[int(t) for t in IDS.split(",")]]))
    acts = {}
    for module in model.modules:
        lo, hi = float(min(tr[module].min(), 0)), float(max(tr[module].max(), 0))
        scale = (hi - lo) / 65535
        acts[module] = {"output": {"0": {"bitwidth": 16, "dtype": "int", "is_symmetric": "False", "scale": scale,
                                         "offset": round(lo / scale)}}}
    acts["model.layers.1.self_attn.q_proj"]["input"] = {"0": {"bitwidth": 8, "dtype": "int", "is_symmetric": "False",
                                                              "scale": 0.05, "offset": -128}}
    acts["model.layers.0.mlp.experts.3.act_fn"] = {"output": {"0": acts["lm_head"]["output"]["0"]}}  # not in refimpl
    encodings = d / "model.encodings"
    encodings.write_text(json.dumps({"activation_encodings": acts, "param_encodings": {}}))
    for name, extra in (("float", []), ("quantised", ["--encodings", str(encodings), "--codes"])):
        assert main(["golden", "--model", "tiny-qwen3", "--input-ids", IDS, "--out", str(d / name), "-q", *extra]) == 0
    return d, encodings


def test_quantised_golden_records_its_quantisers_and_codes(case):
    d, _ = case
    b = read_bundle(d / "quantised")
    q = b.manifest["quantisation"]
    assert q["unplaced"] == ["model.layers.0.mlp.experts.3.act_fn output 0"]
    where = [(x["module"], x["io"]) for x in q["quantisers"]].index(("model.layers.1.self_attn.q_proj", "input"))
    assert {"module": "model.layers.1.self_attn.q_proj", "io": "input", "index": 0,
            "tap": "model.layers.1.input_layernorm"}.items() <= q["quantisers"][where].items()
    codes = b.tensor(0, "tap", "model.norm.codes")
    assert codes.dtype == np.uint16
    enc = next(x for x in q["quantisers"] if x["module"] == "model.norm" and x["io"] == "output")
    np.testing.assert_array_equal((codes.astype(np.float32) + enc["offset"]) * np.float32(enc["scale"]),
                                  b.tensor(0, "tap", "model.norm"))


def _run(*argv):
    return subprocess.run([sys.executable, "-m", "refimpl.cli", *argv], capture_output=True, text=True, check=False)


def test_unplaceable_encodings_warn_in_one_line_and_fail_when_strict(case):
    d, encodings = case
    proc = _run("info", "tiny-qwen3", "--encodings", str(encodings))
    assert proc.returncode == 0 and proc.stderr.count("refimpl: warning:") == 1 and "experts.3.act_fn" in proc.stderr
    assert "weights encodings" in proc.stdout and "52 activation quantisers" in proc.stdout
    proc = _run("run", "tiny-qwen3", "--input-ids", IDS, "--encodings", str(encodings), "--strict-encodings")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--strict-encodings" in proc.stderr
    proc = _run("golden", "--model", "tiny-qwen3", "--input-ids", IDS, "--codes", "--out", str(d / "x"), "-q")
    assert proc.returncode == 2 and "--codes needs activation encodings" in proc.stderr and not (d / "x").exists()


def _dump_of(bundle, to, codes=(), fault=None):
    """The quantised golden's taps and outputs as a device dump; taps named in codes as their integer codes."""
    b = read_bundle(bundle)
    for rec in b.manifest["tensors"].values():
        if rec["role"] == "input" or rec["name"].endswith(".codes"):
            continue
        path = to / "steps" / str(rec["step"]) / rec["role"] / f"{rec['name']}.raw"
        path.parent.mkdir(parents=True, exist_ok=True)
        a = b.tensor(rec["step"], rec["role"], rec["name"]).astype(np.float32)
        if rec["name"] == fault:
            a = a * np.float32(1.01)
        if rec["name"] in codes:
            a = b.tensor(rec["step"], rec["role"], rec["name"] + ".codes")
        a.tofile(path)


def test_three_way_diff_of_a_quantised_device(case, tmp_path):
    d, encodings = case
    _dump_of(d / "quantised", tmp_path / "clean", codes=("model.norm", "model.layers.1.mlp.act_fn"))
    base = ["diff", str(d / "quantised"), None, "--float", str(d / "float"), "--encodings", str(encodings), "-q"]
    base[2] = str(tmp_path / "clean")
    proc = _run(*base)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "explained by quantisation" in proc.stdout and "EXCESS" not in proc.stdout
    _dump_of(d / "quantised", tmp_path / "faulty", fault="model.layers.1.post_attention_layernorm")
    base[2] = str(tmp_path / "faulty")
    proc = _run(*base)
    assert proc.returncode == 1
    assert "first excess beyond quantisation, step 0: model.layers.1.post_attention_layernorm" in proc.stdout
    shutil.rmtree(tmp_path / "faulty")
    for bad, message in ((["--excess", "0.1"], "--excess applies to --float"),
                         (["--float", str(d / "float"), "--emulated", str(d / "float")], "give one")):
        proc = _run("diff", str(d / "quantised"), str(tmp_path / "clean"), *bad)
        assert proc.returncode == 2 and message in proc.stderr
