"""`refimpl generate`: streams the same tokens as refimpl.generate, and bad arguments exit 2 with one line."""

import json
import subprocess
import sys

import pytest

import refimpl
from refimpl.cli import main


def _expected_text(model_name, text, n, **kw):
    tok = refimpl.load_tokenizer(model_name)
    out = refimpl.generate(refimpl.load(model_name), tok.encode(text), max_new_tokens=n,
                           eos_token_id=[151643, 151645], **kw)
    return tok.decode(out.tokens[0], skip_special_tokens=True), out


def test_generate_streams_text_end_to_end():
    proc = subprocess.run([sys.executable, "-m", "refimpl.cli", "generate", "--model", "tiny-qwen3", "--prompt",
                           "Hello, 世界", "--max-new-tokens", "6"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text, out = _expected_text("tiny-qwen3", "Hello, 世界", 6)
    assert proc.stdout == text + "\n"
    assert "6 generated, stopped by length" in proc.stderr and len(out.tokens[0]) == 6


def test_generate_chat_sampling_and_ids(capsys):
    assert main(["generate", "--model", "tiny-qwen3", "--prompt", "Hi", "--chat", "--system", "Be brief.",
                 "--max-new-tokens", "5", "--temperature", "0.8", "--top-k", "20", "--seed", "4", "--ids"]) == 0
    printed = [int(t) for t in capsys.readouterr().out.split()]
    tok = refimpl.load_tokenizer("tiny-qwen3")
    ids = tok.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    out = refimpl.generate(refimpl.load("tiny-qwen3"), ids, max_new_tokens=5, temperature=0.8, top_k=20, seed=4,
                           eos_token_id=[151643, 151645])
    assert printed == out.tokens[0]
    assert main(["generate", "--model", "tiny-qwen3", "--input-ids", "1,2,3", "--max-new-tokens", "3", "--ids"]) == 0
    assert len(capsys.readouterr().out.split()) == 3


def test_generate_without_a_tokenizer_prints_ids(tmp_path, capsys):
    d = refimpl.presets.save_preset("tiny-qwen3", tmp_path / "ckpt")
    assert main(["generate", "--model", str(d), "--input-ids", "1,2,3", "--max-new-tokens", "2"]) == 0
    assert len(capsys.readouterr().out.split()) == 2
    assert main(["generate", "--model", str(d), "--prompt", "hi"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--prompt", "x", "--temperature", "-1"], "temperature must be"),
    (["--prompt", "x", "--top-p", "2"], "top_p must be"),
    (["--prompt", "x", "--top-p", "abc"], "expected a finite number"),
    (["--prompt", "x", "--max-new-tokens", "-1"], "integer >= 0"),
    (["--prompt", "x", "--max-new-tokens", "262144"], "exceeds the model's context limit"),
    (["--input-ids", "1,2", "--chat"], "apply to --prompt text"),
    (["--prompt", "x", "--system", "s"], "--system needs --chat"),
    (["--max-new-tokens", "3"], "give the prompt"),
    (["--prompt", "x", "--input-ids", "1"], "not allowed with"),
    (["--prompt", "x", "--tokenizer", "nowhere"], "not a preset"),
    (["--model", "nowhere", "--input-ids", "1", "--ids"], "not a preset"),
])
def test_generate_bad_arguments_exit_2_with_one_line(args, message, capsys):
    try:
        status = main(["generate", *args])
    except SystemExit as e:          # argparse's own errors
        status = e.code
    out, err = capsys.readouterr()
    assert status == 2 and message in err, err
    assert err.count("\n") == 1 and err.startswith("refimpl: error: ") and out == ""


def test_generate_bad_arguments_in_a_subprocess():
    for args in (["--prompt", "x", "--temperature", "-1"], ["--prompt", "x", "--top-k", "x"]):
        proc = subprocess.run([sys.executable, "-m", "refimpl.cli", "generate", *args], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_golden_prompt_text_uses_the_models_tokenizer(tmp_path, capsys):
    assert main(["golden", "--model", "tiny-qwen3", "--prompt", "Hello world", "--no-taps", "-q",
                 "--out", str(tmp_path / "b")]) == 0
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["prompt_ids"] == refimpl.load_tokenizer("tiny-qwen3").encode("Hello world") == [9707, 1879]


def test_generate_stop_string_and_ignore_eos(capsys):
    assert main(["generate", "--model", "tiny-qwen3", "--input-ids", "1,2,3", "--max-new-tokens", "5"]) == 0
    full = capsys.readouterr().out
    assert len(full) > 4
    stop = full[1:3]
    assert main(["generate", "--model", "tiny-qwen3", "--input-ids", "1,2,3", "--max-new-tokens", "5",
                 "--stop", stop, "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert "stopped by stop" in err and stop in out and full.startswith(out.rstrip("\n")) and len(out) < len(full)
