"""Golden bundles end to end: replaying a bundle's inputs through the graph gives its outputs, bundles are
bit-identical across runs and BLAS thread counts, the committed anchors regenerate bit for bit, and bad
arguments exit 2 with one line."""

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import refimpl
from refimpl.bundle import read_bundle
from refimpl.conventions import genie, qeff
from refimpl.golden import write_golden
from refimpl.presets import PRESETS

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "golden"))
import make_anchors  # noqa: E402


def _same_tree(a: Path, b: Path):
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name != "platform.json")
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name != "platform.json")
    assert files_a == files_b
    mismatch = [str(f) for f in files_a if not filecmp.cmp(a / f, b / f, shallow=False)]
    assert not mismatch, f"files differ: {mismatch[:5]}"


@pytest.mark.parametrize("name", list(PRESETS))
def test_anchor_regenerates_bit_identically(name, tmp_path):
    _same_tree(ROOT / "golden" / name, make_anchors.write_anchor(name, tmp_path / name))


@pytest.mark.parametrize("convention,params,module", [
    ("genie", {"ar": 3, "cl": 12, "key_transposed": False, "kv_output": "window"}, genie),
    ("qeff", {"seq_len": 3, "ctx_len": 12}, qeff)])
def test_replaying_bundle_inputs_reproduces_its_outputs(convention, params, module, tmp_path):
    """What a device does with a bundle: feed each step's inputs, compare the outputs."""
    model = refimpl.load("tiny-qwen3.5-moe")
    path = write_golden(tmp_path / "b", model, [1, 2, 3, 4, 5], source="tiny-qwen3.5-moe", convention=convention,
                        params=params, decode_steps=2)
    b = read_bundle(path)
    opts = module.Options(**params)
    for k, step in enumerate(b.manifest["steps"]):
        inputs = {n: b.tensor(k, "input", n) for n in step["inputs"]}
        outputs = module.graph(model, inputs, opts)
        for n in step["outputs"]:
            np.testing.assert_array_equal(outputs[n], b.tensor(k, "output", n), err_msg=f"step {k} {n}")
    assert b.manifest["generated_ids"] and len(b.manifest["steps"]) == 2 + 2


def test_hf_convention_is_the_dynamic_forward(tmp_path):
    model = refimpl.load("tiny-qwen3")
    path = write_golden(tmp_path / "b", model, [7, 8, 9], source="tiny-qwen3", decode_steps=1, taps=r"^lm_head$")
    b = read_bundle(path)
    np.testing.assert_array_equal(b.tensor(0, "output", "logits"), model.forward(np.array([[7, 8, 9]])))
    np.testing.assert_array_equal(b.tensor(0, "tap", "lm_head"), b.tensor(0, "output", "logits"))
    assert b.tensor(1, "input", "past_key_values.0.key").shape == (1, 2, 3, 32)
    assert b.tensor(1, "output", "present.0.key").shape == (1, 2, 4, 32)


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "refimpl.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_cli_bundles_identical_across_runs_and_blas_threads(tmp_path):
    args = ["golden", "--input-ids", "9707,11,1879,0,315", "--convention", "genie", "--ar", "2", "--cl", "10",
            "--decode-steps", "1", "--taps", r"layers\.[03]\.", "-q"]
    for tag, threads in (("a", "1"), ("b", "2"), ("c", "1")):
        proc = _cli(*args, "--out", str(tmp_path / tag), env={"OPENBLAS_NUM_THREADS": threads})
        assert proc.returncode == 0, proc.stderr
    _same_tree(tmp_path / "a", tmp_path / "b")
    _same_tree(tmp_path / "a", tmp_path / "c")


@pytest.mark.parametrize("args,message", [
    (["--convention", "genie", "--ar", "4", "--cl", "8"], "too small"),
    (["--convention", "genie", "--ar", "16", "--cl", "8"], "smaller than CL"),
    (["--convention", "genie", "--pad-id", "-3"], "pad-id must be"),
    (["--convention", "tflite"], "invalid choice"),
    (["--kv-output", "all"], "invalid choice"),
    (["--decode-steps", "x"], "expected an integer >= 0, got 'x'"),
    (["--convention", "qeff", "--mask-floor", "-50"], "--mask-floor does not apply to --convention qeff"),
    (["--ar", "4"], "--ar does not apply to --convention hf"),
    (["--convention", "qeff", "--pad-side", "left"], "--pad-side does not apply to --convention qeff"),
    (["--convention", "genie", "--pad-side", "middle"], "invalid choice"),
    (["--convention", "genie", "--conv-state-len", "2"], "conv_state_len must be an integer from Kc - 1 = 3 to CL"),
    (["--convention", "genie", "--model", "tiny-qwen3", "--conv-state-len", "4"],
     "hybrid (Gated DeltaNet) models only"),
])
def test_cli_bad_arguments_exit_2(args, message, tmp_path):
    proc = _cli("golden", "--input-ids", "1,2,3,4,5,6,7,8,9,10", *args, "--out", str(tmp_path / "b"))
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "b").exists()


def test_cli_genie_options_reach_the_manifest(tmp_path):
    """Every genie option is a flag, and the manifest records each one as run (pad id and conv state length
    resolved from the model)."""
    proc = _cli("golden", "--input-ids", "9707,11,1879", "--convention", "genie", "--ar", "2", "--cl", "8",
                "--pad-side", "right", "--conv-state-len", "3", "--mask-floor", "-50", "--key-layout", "plain",
                "--kv-output", "window", "--k-prescale", "--decode-ar", "2", "--pad-id", "7", "--no-taps", "-q",
                "--out", str(tmp_path / "b"))
    assert proc.returncode == 0, proc.stderr
    m = read_bundle(tmp_path / "b").manifest
    assert m["convention"]["params"] == {"ar": 2, "cl": 8, "decode_ar": 2, "pad_id": 7, "pad_side": "right",
                                         "mask_floor": -50.0, "key_transposed": False, "kv_output": "window",
                                         "k_prescale": True, "conv_state_len": 3}
    assert m["tensors"]["1/input/input_ids"]["shape"] == [1, 2] and m["tensors"]["1/input/conv_state_0_in"]["shape"] \
        == [1, 128, 3]
    assert read_bundle(tmp_path / "b").tensor(1, "input", "input_ids").tolist() == [[1879, 7]]   # right-padded
    defaults = _cli("golden", "--input-ids", "9707,11,1879", "--convention", "genie", "--ar", "2", "--cl", "8",
                    "--no-taps", "-q", "--out", str(tmp_path / "d"))
    assert defaults.returncode == 0, defaults.stderr
    params = read_bundle(tmp_path / "d").manifest["convention"]["params"]
    assert (params["pad_side"], params["mask_floor"], params["conv_state_len"], params["pad_id"]) == \
        ("left", -100.0, 4, PRESETS["tiny-qwen3.5"]["eos_token_id"])


@pytest.mark.parametrize("convention,params", [("hf", {}), ("genie", {"ar": 2, "cl": 10}),
                                               ("qeff", {"seq_len": 2, "ctx_len": 10})])
def test_manifest_records_the_generation(convention, params, tmp_path):
    """generation: the greedy token and its log-prob at each step's last real position, read back from the
    bundle's own logits; the fed-back part equals generated_ids and refimpl.generate's greedy tokens."""
    model = refimpl.load("tiny-qwen3.5", dtype="float64")
    prompt = [9707, 11, 1879, 0, 315]
    b = read_bundle(write_golden(tmp_path / "b", model, prompt, source="tiny-qwen3.5", convention=convention,
                                 params=params, decode_steps=3, taps=None))
    g = b.manifest["generation"]
    assert g["tokens"][:-1] == b.manifest["generated_ids"] and len(g["tokens"]) == 4
    assert g["steps"] == list(range(len(b.manifest["steps"]) - 4, len(b.manifest["steps"])))
    for k, pos, t, lp in zip(g["steps"], g["positions"], g["tokens"], g["logprobs"]):
        logits = b.tensor(k, "output", "logits")[0, pos].astype(np.float64)
        assert t == int(np.argmax(logits))
        assert lp == pytest.approx(logits[t] - logits.max() - np.log(np.exp(logits - logits.max()).sum()), abs=1e-12)
    # float64: the device convention's tokens are the model's own greedy tokens
    assert g["tokens"] == refimpl.generate(model, prompt, max_new_tokens=4, eos_token_id=()).tokens[0]
