"""The CLI: useful output, and one-line errors with exit status 2."""

import json

import ml_dtypes
import numpy as np
import pytest

import refimpl
from refimpl.bundle import read_bundle
from refimpl.cli import main
from refimpl.golden import write_golden


def test_info(capsys):
    assert main(["info", "tiny-qwen3-moe"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_moe" in out and "8 x 32, top-2" in out and "parameters" in out
    assert "activations float32, weights float32" in out
    assert main(["info", "tiny-qwen3", "--precision", "bf16", "--kv", "fp16"]) == 0
    assert "activations bf16, weights bf16, kv fp16" in capsys.readouterr().out


def test_run_prints_top_tokens(capsys):
    assert main(["run", "tiny-qwen3", "--input-ids", "1,2,3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("next-token top-5 after 3 tokens") and len(lines) == 6


@pytest.mark.parametrize("argv,message", [
    (["run", "tiny-qwen3", "--input-ids", "1,x"], "comma-separated integers"),
    (["run", "tiny-qwen3", "--input-ids", "1,999999999"], "outside the vocabulary"),
    (["run", "nowhere/model", "--input-ids", "1"], "not a preset"),
    (["info"], "required"),
    (["run", "tiny-qwen3", "--input-ids", "99999999999999999999"], "token ids in"),
    (["run", "tiny-qwen3", "--input-ids", "1", "--top", "0"], "positive integer"),
    (["frobnicate"], "invalid choice"),
    (["run", "tiny-qwen3", "--input-ids", "1", "--dtype", "float64", "--precision", "bf16"], "contradicts"),
    (["run", "tiny-qwen3", "--input-ids", "1", "--weights", "int5-per-channel-qnn"], "precision weights"),
    (["run", "tiny-qwen3", "--input-ids", "1", "--encodings", "no/such.json"], "no such file (encodings file)"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capfd):
    """Through main() in this process (tests/test_cli_errors.py runs the CLI as a process too)."""
    try:
        status = main(argv)
    except SystemExit as e:   # argparse's own errors
        status = e.code
    err = capfd.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_golden_records_the_precision_policy(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["golden", "--model", "tiny-qwen3", "--input-ids", "1,2,3", "--precision", "bf16", "--kv", "int8",
                 "--weights", "int8-per-channel-qnn", "--out", str(out), "--no-taps", "-q"]) == 0
    assert "bf16 activations" in capsys.readouterr().out
    b = read_bundle(out)
    p = b.manifest["precision"]
    assert (p["activations"], p["weights"], p["kv"], p["arithmetic"]) == ("bf16", "int8-per-channel-qnn", "int8",
                                                                         "correctly-rounded")
    assert p["cast_points"] and json.loads((out / "manifest.json").read_text())["precision"] == p
    logits = b.tensor(0, "output", "logits")
    assert np.array_equal(logits, logits.astype(ml_dtypes.bfloat16).astype(logits.dtype))


def test_golden_delta_rule_chunk_changes_only_the_gdn_core_and_is_recorded(tmp_path, capsys):
    """--delta-rule-chunk: htp-fp16 with AI Hub's chunked rule. Recorded in the manifest; the taps before the
    first delta rule are bit-identical to the token-by-token emulation's, its core is not; without htp-fp16 it is
    bad input."""
    args = ["golden", "--model", "tiny-qwen3.5", "--input-ids", "1,2,3,4,5", "--precision", "htp-fp16", "-q",
            "--taps", "layers\\.0\\.linear_attn\\.(q|core)$"]
    assert main([*args, "--out", str(tmp_path / "tok")]) == 0
    assert main([*args, "--delta-rule-chunk", "64", "--out", str(tmp_path / "chunk")]) == 0
    tok, chunk = read_bundle(tmp_path / "tok"), read_bundle(tmp_path / "chunk")
    assert chunk.manifest["precision"]["delta_rule_chunk"] == 64 and "delta_rule_chunk" not in tok.manifest["precision"]
    q = "model.layers.0.linear_attn.q"
    assert np.array_equal(tok.tensor(0, "tap", q), chunk.tensor(0, "tap", q))
    core = "model.layers.0.linear_attn.core"
    a, b = tok.tensor(0, "tap", core), chunk.tensor(0, "tap", core)
    assert not np.array_equal(a, b) and np.abs(a - b).max() < 0.01 * np.abs(a).max()
    capsys.readouterr()
    assert main(["golden", "--model", "tiny-qwen3.5", "--input-ids", "1,2", "--precision", "fp16",
                 "--delta-rule-chunk", "64", "--out", str(tmp_path / "bad"), "-q"]) == 2
    assert "delta_rule_chunk" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_golden_follow_decodes_the_followed_bundles_tokens(tmp_path, capsys):
    """An emulated-precision bundle for three-way judging follows the golden's generated tokens (teacher forcing):
    its decode calls feed them, whatever its own greedy choices, and its generation record says so."""
    followed = write_golden(tmp_path / "g", refimpl.load("tiny-qwen3"), [1, 2, 3], source="tiny-qwen3",
                            decode_steps=2, decode_ids=[5, 6])          # not what greedy decoding picks
    assert main(["golden", "--model", "tiny-qwen3", "--input-ids", "1,2,3", "--follow", str(followed), "--out",
                 str(tmp_path / "f"), "--no-taps", "-q"]) == 0
    f = read_bundle(tmp_path / "f").manifest
    assert f["generated_ids"] == [5, 6] and [s["tokens"] for s in f["steps"]] == [[1, 2, 3], [5], [6]]
    assert "teacher forcing" in f["generation"]["fed"] and f["generation"]["tokens"][0] != 5
    capsys.readouterr()
    assert main(["golden", "--model", "tiny-qwen3", "--input-ids", "1,2,4", "--follow", str(followed), "--out",
                 str(tmp_path / "x"), "--no-taps", "-q"]) == 2
    assert "its prompt differs" in capsys.readouterr().err
