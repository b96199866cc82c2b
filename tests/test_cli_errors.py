"""Every subcommand given bad arguments: exit status 2, exactly one line on stderr (`refimpl: error: ...`), nothing
on stdout and no file written (not in the working directory, not in the inputs)."""

import os
import subprocess
import sys

import pytest

from refimpl.cli import build_parser, main

# {b}: a golden bundle; {deep}: JSON nested 100,000 levels; {fifo}: a named pipe (reading it would block forever);
# {bad}: truncated JSON; {list}: a JSON list where an object belongs; {text}: a small text file
CASES = {
    "info": [
        ["info", "nowhere/model"],
        ["info", "tiny-qwen3", "--precision", "fp7"],
        ["info", "{deep}"],
        ["info", "tiny-qwen3", "--weights", "encodings", "--encodings", "{fifo}"],
    ],
    "run": [
        ["run", "tiny-qwen3", "--input-ids", "1,x"],
        ["run", "tiny-qwen3", "--input-ids", "1", "--top", "0"],
        ["run", "tiny-qwen3", "--input-ids", "1", "--weights", "encodings", "--encodings", "{deep}"],
    ],
    "convert": [
        ["convert", "tiny-qwen3", "--out", "x.gguf", "--type", "q5_k"],
        ["convert", "nowhere/model", "--out", "x.gguf"],
    ],
    "golden": [
        ["golden", "--input-ids", "1,2", "--model", "tiny-qwen3", "--taps", "[", "--out", "o"],
        ["golden", "--input-ids", "1,2", "--model", "tiny-qwen3", "--convention", "genie", "--ar", "4", "--cl", "30",
         "--out", "o"],
        ["golden", "--input-ids", "1,2", "--model", "tiny-qwen3", "--convention", "genie", "--ar", "4",
         "--decode-ar", "8", "--cl", "32", "--out", "o"],
        ["golden", "--input-ids", "1,2", "--convention", "genie", "--mask-floor", "nan", "--out", "o"],
        ["golden", "--input-ids", "1,2", "--model", "tiny-qwen3", "--convention", "qeff", "--cl", "100000",
         "--out", "o"],
        ["golden", "--input-ids", "1,2", "--model", "tiny-qwen3", "--weights", "encodings", "--encodings", "{deep}",
         "--out", "o"],
        ["golden", "--input-ids", "1,2", "--model", "tiny-qwen3", "--export", "onnx", "--out", "o"],
        ["golden", "--input-ids", "1,2", "--model", "tiny-qwen3", "--out", "{b}"],   # exists: never overwritten
    ],
    "generate": [
        ["generate", "--input-ids", "1,2", "--model", "tiny-qwen3", "--temperature", "nan"],
        ["generate", "--input-ids", "1,2", "--model", "tiny-qwen3", "--max-new-tokens", "-1"],
        ["generate", "--input-ids", "1,2", "--model", "tiny-qwen3", "--top-p", "2"],
        ["generate", "--input-ids", "1,2", "--model", "tiny-qwen3", "--tokenizer", "{deep}"],
    ],
    "diff": [
        ["diff", "nowhere", "{b}"],
        ["diff", "{b}", "{b}", "--policy", "{deep}", "--json", "m.json", "--html", "r.html"],
        ["diff", "{b}", "{b}", "--policy", "{fifo}"],
        ["diff", "{b}", "{b}", "--policy", "{bad}"],
        ["diff", "{b}", "{b}", "--policy", "{list}"],
        ["diff", "{b}", "{b}", "--mapping", "{deep}"],
        ["diff", "{b}", "{b}", "--mapping", "{fifo}"],
        ["diff", "{b}", "{b}", "--mapping", "{list}"],
        ["diff", "{b}", "--rejudge", "{deep}"],
        ["diff", "{b}", "--rejudge", "{fifo}"],
        ["diff", "{b}", "{b}", "--layout", "[=aimet"],
        ["diff", "{b}", "{b}", "--layout", "x=sideways"],
        ["diff", "{b}", "{b}", "--k", "nan"],
        ["diff", "{b}", "{b}", "--top", "-1"],
        ["diff", "{b}", "{b}", "--dump-dtype", "int7"],
        ["diff", "{b}", "{b}", "--float", "{b}", "--excess", "nan"],
        ["diff", "{b}", "{b}", "--encodings", "{deep}"],
    ],
    "replay": [
        ["replay", "{b}", "{b}", "--layer", "-1"],
        ["replay", "{b}", "{b}", "--layer", "0", "--step", "99"],
        ["replay", "{b}", "nowhere", "--layer", "0"],
        ["replay", "{b}", "{b}", "--layer", "0", "--mapping", "{fifo}"],
    ],
    "explain": [
        ["explain", "{b}", "x["],
        ["explain", "{b}", "model.norm[0,0,0]", "--step", "-1"],
        ["explain", "{b}", "model.layers.0.mlp.down_proj[0,99,0]"],
    ],
    "reference": [
        ["reference", "--model", "tiny-qwen3", "--text", "nowhere.txt", "--out", "r"],
        ["reference", "--model", "tiny-qwen3", "--text", "{text}", "--ctx", "0", "--out", "r"],
        ["reference", "--model", "tiny-qwen3", "--text", "{text}", "--ctx", "8", "--stride", "9", "--out", "r"],
        ["reference", "--model", "tiny-qwen3", "--jsonl", "{fifo}", "--out", "r"],
        ["reference", "--model", "tiny-qwen3", "--jsonl", "{deep}", "--ctx", "8", "--out", "r"],
    ],
    "compare-logits": [
        ["compare-logits", "nowhere", "{b}"],
        ["compare-logits", "{b}", "{b}", "--policy", "max_mean_kld=x"],
        ["compare-logits", "{b}", "{b}", "--policy", "{deep}"],
    ],
    "export-kld-base": [
        ["export-kld-base", "nowhere", "out.kld"],
        ["export-kld-base", "{b}", "out.kld"],
    ],
}


def _tree(root) -> dict:
    """path -> (size, mtime) of every file and directory under root."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-inputs")
    assert main(["golden", "--model", "tiny-qwen3", "--input-ids", "1,2,3,4,5", "--convention", "genie", "--ar", "4",
                 "--cl", "16", "--taps", r"layers\.0\.mlp", "--out", str(root / "bundle"), "-q"]) == 0
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "bad.json").write_text('{"a": ')
    (root / "list.json").write_text("[1, 2]")
    (root / "text.txt").write_text("Hello world. " * 20)
    os.mkfifo(root / "fifo.json")
    paths = {"b": root / "bundle", "deep": root / "deep.json", "fifo": root / "fifo.json", "bad": root / "bad.json",
             "list": root / "list.json", "text": root / "text.txt"}
    return root, {k: str(v) for k, v in paths.items()}


def test_every_subcommand_is_listed():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(CASES)


def _in_a_process(argv) -> bool:
    """The first case of each subcommand and every named-pipe case run as `python -m refimpl` (the process path,
    with a timeout should the pipe ever be opened); the others through main() in this process (the same code,
    without a second of interpreter start-up and imports each)."""
    return any(argv == cases[0] for cases in CASES.values()) or any("{fifo}" in a for a in argv)


def _run(case, paths, work, capfd, monkeypatch) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the CLI given a case's arguments (their {names} from paths), run in the
    directory `work`."""
    argv = [a.format(**paths) for a in case]
    if _in_a_process(case):
        proc = subprocess.run([sys.executable, "-m", "refimpl", *argv], cwd=work, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
        return proc.returncode, proc.stdout, proc.stderr
    monkeypatch.chdir(work)
    capfd.readouterr()
    try:
        status = main(argv)
    except SystemExit as e:   # argparse's own errors
        status = e.code
    out, err = capfd.readouterr()
    return status, out, err


@pytest.mark.parametrize("argv", [a for cases in CASES.values() for a in cases], ids=lambda a: " ".join(a)[:70])
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(argv, inputs, tmp_path, capfd, monkeypatch):
    root, paths = inputs
    before = _tree(root)
    work = tmp_path / "work"
    work.mkdir()
    status, out, err = _run(argv, paths, work, capfd, monkeypatch)
    assert (status, out) == (2, ""), err
    assert err.startswith("refimpl: error: ") and err.count("\n") == 1, err
    assert list(work.iterdir()) == []
    assert _tree(root) == before
