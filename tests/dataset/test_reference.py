"""refimpl reference / compare-logits: windows as llama-perplexity cuts them, identical files however the windows
are spread or interrupted, and the device statistics against an independent float64 computation."""

import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import gguf_cases
import refimpl
from refimpl.bundle import read_bundle
from refimpl.cli import main
from refimpl.dataset import (
    compact,
    compare_logits,
    cut,
    open_reference,
    read_documents,
    read_kld_base,
    stats,
    write_kld_base,
)
from refimpl.dataset.reference import Job, window_logits, write_reference

CTX = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A 320-token Qwen3 checkpoint and a JSON-lines dataset of three documents (81 windows of 32 tokens)."""
    root = tmp_path_factory.mktemp("dataset")
    gguf_cases.write_checkpoint("qwen3", root / "qwen3")
    rng = np.random.default_rng(3)
    with open(root / "data.jsonl", "w") as f:
        for n in (2400, 170, 40):
            f.write(json.dumps({"input_ids": rng.integers(0, 300, n).tolist()}) + "\n")
    return root


def _run(data, out, *extra):
    return main(["reference", "--model", str(data / "qwen3"), "--jsonl", str(data / "data.jsonl"), "--ctx",
                 str(CTX), "--out", str(out), "-q", *extra])


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def ref(data):
    assert _run(data, data / "ref") == 0
    return open_reference(data / "ref")


# ------------------------------------------------------------------------------------------------ windows

def test_windows_cut_as_llama_perplexity():
    doc = list(range(100, 110))                            # N = 10
    w = cut([doc], ctx=4)                                  # n_chunk = N // ctx = 2; first = 2; ctx - 1 - first = 1
    assert w.tokens.tolist() == [[100, 101, 102, 103], [104, 105, 106, 107]]
    assert w.first == 2 and w.targets.tolist() == [[103], [107]]
    s = cut([doc], ctx=4, stride=2)                        # ceil((N - ctx) / stride) = 3 windows at 0, 2, 4
    assert [r[0] for r in s.tokens.tolist()] == [100, 102, 104]
    assert s.first == 1 and s.targets.tolist() == [[102, 103], [104, 105], [106, 107]]   # positions ctx-s-1 .. ctx-2
    assert cut([doc], ctx=4, bos=1).tokens[:, 0].tolist() == [1, 1]
    assert cut([doc, doc[:3]], ctx=4).documents == [(0, 0), (0, 4)]


def test_reference_values(ref, data):
    """Window files hold the NLL and top ids of the model's logits (the portable float32 log-sum-exp: within 1e-6
    nats of NumPy's float64 log-softmax), and the compact rows."""
    model = refimpl.load(str(data / "qwen3"))
    k = 5
    with threadpool_limits(1):
        logits = model.forward(ref.tokens[k][None].astype(np.int64))[0, ref.first:ref.first + ref.scored]
    logp = compact.log_softmax64(logits)
    w = ref.window(k)
    rows = np.arange(ref.scored)
    np.testing.assert_array_equal(w["nll"], -compact.log_softmax(logits)[rows, ref.targets[k]])
    np.testing.assert_allclose(w["nll"], -logp[rows, ref.targets[k]], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(w["top_ids"][:, 0], np.argmax(logits, -1))
    assert np.abs(compact.decode(w["codes"], w["scale"], w["floor"]) - logp).max() <= w["scale"].max() / 2 + 1e-5
    summary = json.loads((data / "ref" / "summary.json").read_text())
    assert summary["windows"] == ref.count == 2400 // CTX + 170 // CTX + 40 // CTX
    assert summary["bytes_per_scored_token"] < 2 * ref.vocab + 400


def test_processes_identical_to_serial(ref, data):
    assert _run(data, data / "ref2", "--workers", "2") == 0
    assert _files(data / "ref2") == _files(data / "ref")


def test_ray_identical_to_serial(ref, data):
    pytest.importorskip("ray")
    assert _run(data, data / "ref-ray", "--ray", "--workers", "2") == 0
    assert _files(data / "ref-ray") == _files(data / "ref")


def _start(cmd, out, env, **kw):
    """The command in its own session, with Ctrl-C's default disposition (an xdist worker ignores SIGINT, and a
    child inherits an ignored signal: Python then installs no KeyboardInterrupt handler)."""
    return subprocess.Popen(cmd + ["--out", str(out)], env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kw)


def _first_window(p, out) -> float:
    """Wait until the run has written its first window (or ended); the time it took."""
    t0 = time.perf_counter()
    while not list((out / "windows").glob("*.safetensors")) and p.poll() is None:
        time.sleep(0.005)
    return time.perf_counter() - t0


def test_killed_runs_resume_to_identical_files(data, tmp_path):
    """Acceptance: SIGKILL at random points of the window phase (several trials, one and two workers), then the
    same command again, ends with the bytes of the uninterrupted run; Ctrl-C stops cleanly with exit 130 and
    the run resumes too."""
    rng = np.random.default_rng(4)
    # 125 windows: every kill point is still drawn over the whole window phase (its count of windows written, then
    # within a window), the resumed bytes compared whole; each run's windows are half of 8000 tokens' 250
    (tmp_path / "long.jsonl").write_text(json.dumps({"input_ids": rng.integers(0, 300, 4000).tolist()}) + "\n")
    cmd = [sys.executable, "-m", "refimpl.cli", "reference", "--model", str(data / "qwen3"), "--jsonl",
           str(tmp_path / "long.jsonl"), "--ctx", str(CTX), "-q"]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    p = _start(cmd, tmp_path / "whole", env)
    _first_window(p, tmp_path / "whole")
    t0 = time.perf_counter()
    assert p.wait() == 0
    phase = time.perf_counter() - t0                       # how long the windows take after the first one
    want = _files(tmp_path / "whole")
    count = len(list((tmp_path / "whole" / "windows").iterdir()))
    rnd = random.Random(15)
    partial = []                                           # windows on disk after each kill
    for trial in range(4):
        out, workers = tmp_path / f"t{trial}", ["--workers", str(1 + trial % 2)]
        for _ in range(2):                                 # two interruptions per trial
            p = _start(cmd + workers, out, env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            target = rnd.randint(1, count - 1)             # a random point of the window phase, then within a window
            while len(list((out / "windows").glob("*.safetensors"))) < target and p.poll() is None:
                time.sleep(0.001)
            time.sleep(rnd.uniform(0, 2 * phase / count))
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                partial.append(len(list((out / "windows").glob("*.safetensors"))))
        subprocess.run(cmd + workers + ["--out", str(out)], check=True, env=env, capture_output=True)
        assert _files(out) == want, f"trial {trial}"
    assert sum(0 < n < count for n in partial) >= 3, f"kills did not land while windows were written: {partial}"
    for attempt in range(5):  # the whole run takes ~1 s: on a busy machine it may end before the signal lands
        out = tmp_path / f"sigint{attempt}"
        p = _start(cmd, out, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _first_window(p, out)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate()
        if p.returncode == 0 and len(list((out / "windows").iterdir())) == count:
            assert _files(out) == want                    # it finished first: the complete files
            continue
        assert (p.returncode, stderr.strip()) == (130, ""), stdout
        assert "run the same command again to resume" in stdout
        subprocess.run(cmd + ["--out", str(out)], check=True, env=env, capture_output=True)
        assert _files(out) == want
        break
    else:
        raise AssertionError("Ctrl-C never interrupted a run in 5 attempts")


def test_other_settings_refused(ref, data, capsys):
    assert _run(data, data / "ref", "--top-k", "5") == 2
    assert "other settings (top_k differs)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ compare

def _device(data, ref, precision="bf16"):
    model = refimpl.load(str(data / "qwen3"), precision=precision)
    return [model.forward(ref.tokens[k][None].astype(np.int64)) for k in range(ref.count)]


def _float64_stats(data, ref, device):
    """Independent of the compact form: every per-token quantity from the two models' float32 logits."""
    model = refimpl.load(str(data / "qwen3"))
    kld, nll, nll_ref, same = [], [], [], []
    for k in range(ref.count):
        rows = slice(ref.first, ref.first + ref.scored)
        with threadpool_limits(1):
            p = compact.log_softmax64(model.forward(ref.tokens[k][None].astype(np.int64))[0, rows])
        q = compact.log_softmax64(device[k][0, rows])
        t = ref.targets[k]
        r = np.arange(len(t))
        kld.append((np.exp(p) * (p - q)).sum(-1))
        nll.append(-q[r, t])
        nll_ref.append(-p[r, t])
        same.append(np.argmax(p, -1) == np.argmax(q, -1))
    return [np.concatenate(x) for x in (kld, nll, nll_ref, same)]


def test_compare_against_float64(ref, data, tmp_path):
    device = _device(data, ref)
    np.savez(tmp_path / "dev.npz", **{f"{k}/logits": d for k, d in enumerate(device)})
    report = compare_logits(ref, tmp_path / "dev.npz")
    kld, nll, nll_ref, same = _float64_stats(data, ref, device)
    exact = stats.distribution(kld)
    assert report["tokens"] == len(kld) == ref.count * ref.scored
    assert abs(report["kld"]["mean"] - exact["mean"]) <= report["kld_bound"]["mean"]
    for key in ("median", "p99", "p99.9", "max"):
        assert abs(report["kld"][key] - exact[key]) <= report["kld_bound"]["max"], key
    assert report["kld"]["mean"] > 50 * report["kld_bound"]["mean"]          # bf16 error is resolved
    assert report["same_top"]["value"] == same.mean()
    assert report["ppl"]["value"] == pytest.approx(np.exp(nll.mean()), rel=1e-12)
    # the stored NLL is the float32 log-sum-exp correctly rounded (within 1e-6 nats of float64's): ppl to 1e-6
    assert report["ppl_reference"]["value"] == pytest.approx(np.exp(nll_ref.mean()), rel=1e-6)
    diff = report["ppl_difference"]
    assert diff["ci95"][0] <= diff["value"] <= diff["ci95"][1] and diff["uncertainty"] > 0
    assert len(report["per_position"]["mean_kld"]) == ref.scored
    worst = report["worst_positions"][0]
    assert worst["kld"] == report["kld"]["max"]
    # the drill-down command writes the golden bundle of that window up to that position
    args = shlex.split(worst["drill_down"])
    args[args.index("--out") + 1] = str(tmp_path / "drill")
    assert args[:2] == ["refimpl", "golden"] and main(args[1:] + ["--no-taps", "-q"]) == 0
    logits = read_bundle(tmp_path / "drill").tensor(0, "output", "logits")[0, -1]
    assert -compact.log_softmax64(logits)[worst["target"]] == pytest.approx(worst["nll_reference"], rel=1e-6)


def test_device_layouts_and_policy(ref, data, tmp_path, capsys):
    """qnn-net-run directories (float32, float16 with --dump-dtype, a renamed output through --mapping) and
    scored-rows-only .npy give the statistics of the .npz; a missed --policy bar exits 1."""
    device = _device(data, ref)
    np.savez(tmp_path / "dev.npz", **{f"{k}/logits": d for k, d in enumerate(device)})
    for k, d in enumerate(device):
        (tmp_path / "qnn" / f"Result_{k}").mkdir(parents=True)
        d.astype(np.float32).tofile(tmp_path / "qnn" / f"Result_{k}" / "output_0.raw")
        (tmp_path / "f16" / f"Result_{k}").mkdir(parents=True)
        d.astype(np.float16).tofile(tmp_path / "f16" / f"Result_{k}" / "logits.raw")
        (tmp_path / "rows" / str(k)).mkdir(parents=True)
        np.save(tmp_path / "rows" / str(k) / "logits.npy", d[0, ref.first:ref.first + ref.scored])
    (tmp_path / "map.json").write_text(json.dumps({"logits": "output_0"}))
    base = compare_logits(ref, tmp_path / "dev.npz")
    for args in (["qnn", "--mapping", str(tmp_path / "map.json")], ["rows"]):
        out = tmp_path / f"{args[0]}.json"
        assert main(["compare-logits", str(data / "ref"), str(tmp_path / args[0]), "-q", "--json", str(out),
                     *args[1:]]) == 0
        assert json.loads(out.read_text())["kld"] == base["kld"]
    f16 = compare_logits(ref, tmp_path / "f16", dtype="float16")
    assert f16["kld"] == base["kld"]        # bf16-valued logits are exact in float16; read as float32 they'd not fit
    html = tmp_path / "r.html"
    assert main(["compare-logits", str(data / "ref"), str(tmp_path / "dev.npz"), "-q", "--html", str(html),
                 "--policy", f"max_mean_kld={base['kld']['mean'] / 2},min_top1=0.5"]) == 1
    assert "FAIL max_mean_kld" in capsys.readouterr().out
    assert html.read_text().count("data:image/png;base64") == 2
    assert main(["compare-logits", str(data / "ref"), str(tmp_path / "dev.npz"), "-q", "--policy", "max_kld=1"]) == 2
    assert main(["compare-logits", str(data / "ref"), str(tmp_path / "nothing.npz"), "-q"]) == 2


def test_export_kld_base_round_trip(ref, data, tmp_path):
    path = write_kld_base(ref, tmp_path / "ref.kld")
    base = read_kld_base(path)
    assert base["n_ctx"] == CTX and base["n_vocab"] == ref.vocab
    np.testing.assert_array_equal(base["tokens"], ref.tokens)
    w = ref.window(3)
    np.testing.assert_array_equal(base["codes"][3], w["codes"])
    np.testing.assert_array_equal(base["scale"][3], w["scale"])
    np.testing.assert_array_equal(base["min_log_prob"][3], w["floor"])


def test_genie_convention_reference(data, tmp_path):
    """Any convention: genie's AR-chunked calls give the hf logits rows to float32 rounding."""
    model = refimpl.load(str(data / "qwen3"))
    ids = np.arange(CTX) + 7
    hf = window_logits(model, ids)
    genie = window_logits(model, ids, "genie", {"ar": 8, "cl": 64})
    np.testing.assert_allclose(genie, hf, rtol=0, atol=2e-5)
    windows = cut([list(range(3 * CTX))], CTX)
    job = Job(str(data / "qwen3"), model.precision, "genie", (("ar", 8), ("cl", 64)), windows.first, windows.scored)
    write_reference(tmp_path / "g", job, windows, {"stride": None})
    assert open_reference(tmp_path / "g").manifest["convention"] == {"name": "genie", "params": {"ar": 8, "cl": 64}}


def test_text_stride_and_bad_input(data, tmp_path, capsys):
    """--text with the model's tokenizer and --stride (windows as perplexity_v2 cuts them); bad input: one line,
    exit 2, nothing written."""
    text = "The quick brown fox jumps over the lazy dog. " * 40
    (tmp_path / "t.txt").write_text(text)
    n = len(refimpl.load_tokenizer(str(data / "qwen3")).encode(text))
    assert main(["reference", "--model", str(data / "qwen3"), "--text", str(tmp_path / "t.txt"), "--ctx", "64",
                 "--stride", "16", "--out", str(tmp_path / "s"), "-q"]) == 0
    ref = open_reference(tmp_path / "s")
    assert ref.count == -(-(n - 64) // 16) and (ref.first, ref.scored) == (64 - 16 - 1, 16)
    with pytest.raises(Exception, match="stride"):
        write_kld_base(ref, tmp_path / "s.kld")
    capsys.readouterr()
    bad = [["--text", str(tmp_path / "missing.txt")], ["--jsonl", str(tmp_path / "t.txt")],
           ["--text", str(tmp_path / "t.txt"), "--ctx", "5000"], ["--text", str(tmp_path / "t.txt"), "--stride", "64"],
           ["--text", str(tmp_path / "t.txt"), "--ar", "8"]]
    for args in bad:
        out = tmp_path / "bad"
        assert main(["reference", "--model", str(data / "qwen3"), "--ctx", "64", *args, "--out", str(out), "-q"]
                    if "--ctx" not in args else ["reference", "--model", str(data / "qwen3"), *args, "--out",
                                                 str(out), "-q"]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("refimpl: error: ") and err.count("\n") == 1, err
        assert not out.exists()


def test_damaged_window_is_recomputed_and_jsonl_text(ref, data, tmp_path):
    """A window file that is not whole (a disk that lied about a write) is computed again on resume, and
    compare-logits refuses an unfinished reference; --jsonl text records are tokenised with the model's
    tokenizer."""
    shutil.copytree(data / "ref", tmp_path / "r")
    path = tmp_path / "r" / "windows" / "000007.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    (tmp_path / "r" / "windows" / "000009.safetensors").unlink()
    with pytest.raises(Exception, match="80 of 81 windows are computed"):
        compare_logits(open_reference(tmp_path / "r"), tmp_path / "none.npz")
    assert _run(data, tmp_path / "r") == 0
    assert _files(tmp_path / "r") == _files(data / "ref")
    text = "Hello world, again and again. " * 20
    (tmp_path / "t.jsonl").write_text(json.dumps({"body": text}) + "\n")
    tok = refimpl.load_tokenizer(str(data / "qwen3"))
    assert read_documents(jsonl=str(tmp_path / "t.jsonl"), field="body", tokenizer=lambda: tok) == [tok.encode(text)]
