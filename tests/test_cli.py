"""The CLI: useful output, and one-line errors with exit status 2."""

import subprocess
import sys

import pytest

from refimpl.cli import main


def test_info(capsys):
    assert main(["info", "tiny-qwen3-moe"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_moe" in out and "8 x 32, top-2" in out and "parameters" in out


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
])
def test_bad_arguments_exit_2_with_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "refimpl.cli", *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "Traceback" not in proc.stderr
