"""refimpl diff: reading dumps (formats, names, layouts, damage), policies and re-judging, the CLI, the HTML
report in a headless browser, and explain."""

import json
import shutil
import subprocess

import faults as F
import numpy as np
import pytest

from refimpl.bundle import read_bundle
from refimpl.cli import main
from refimpl.diff.compare import check_same_case, compare
from refimpl.diff.dump import read_dump, read_mapping
from refimpl.diff.explain import explain
from refimpl.diff.metrics import tensor_metrics
from refimpl.diff.policy import judge, judged_nmse, load_policy, make_policy
from refimpl.diff.saved import load_metrics, rejudge, save_metrics
from refimpl.errors import InputError
from refimpl.golden import write_golden
from refimpl.models.model import Model
from refimpl.models.weights import Weights

PROMPT = [97, 11, 1879, 13, 42]
PARAMS = {"ar": 4, "cl": 16, "mask_floor": -1000.0, "pad_side": "right"}   # step 0: four real tokens


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    model, arrays = F.model_and_arrays("tiny-qwen3.5", vocab_size=2048, eos_token_id=2000)
    root = tmp_path_factory.mktemp("diff")
    path = write_golden(root / "golden", model, PROMPT, source="tiny-qwen3.5", convention="genie", params=PARAMS,
                        decode_steps=1, taps=".", exports=("npz", "safetensors"), aimet=True)
    clean = F.device_dump(model, PROMPT, PARAMS, 1, root / "clean")
    return model, read_bundle(path), root, clean


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _status(report, key):
    return next(r for r in report.results if r.key == key)


# ------------------------------------------------------------------------------------------------ reading

def test_containers_npz_safetensors_and_bundle_layout_pass(case):
    model, bundle, root, _ = case
    for path in (bundle.path / "bundle.npz", bundle.path / "bundle.safetensors"):
        report = compare(bundle, read_dump(path, bundle))
        assert report.failed == [] and report.unknown == []
        assert len(report.results) == len(bundle.manifest["tensors"])  # inputs too: every tensor scored


def test_aimet_layout_is_detected_and_declared(case):
    model, bundle, root, _ = case
    aimet = bundle.path / "aimet" / "outputs"
    report = compare(bundle, read_dump(aimet, bundle))
    four_d = [r for r in report.results if r.status == "layout"]
    assert four_d and all(r.layout in ("aimet", "nhwc") for r in four_d)  # read as is they fail; adapters match
    assert all(r.status in ("pass", "layout") for r in report.results)
    declared = compare(bundle, read_dump(aimet, bundle), make_policy({"layouts": {".": "aimet"}}))
    assert declared.failed == [] and declared.exit_code == 0


def test_sanitised_names_mapping_and_unknown_files(case, tmp_path):
    model, bundle, root, clean = case
    d = _copy(clean, tmp_path / "dump")
    (d / "Result_0" / "model.layers.0.linear_attn.q.raw").rename(d / "Result_0" / "model.layers.0.linear_attn:q.raw")
    (d / "Result_0" / "model.layers.0.linear_attn.k.raw").rename(d / "Result_0" / "model_layers_0_linear_attn_k.raw")
    (d / "Result_0" / "model.layers.0.linear_attn.v.raw").rename(d / "Result_0" / "vvv.raw")
    (d / "Result_0" / "garbage.raw").write_bytes(b"\0" * 12)
    (d / "notes.txt").write_text("hello")
    report = compare(bundle, read_dump(d, bundle))
    assert _status(report, "0/tap/model.layers.0.linear_attn.q").status == "pass"      # ':' -> '_'... '.'
    assert _status(report, "0/tap/model.layers.0.linear_attn.k").status == "pass"      # '.' -> '_'
    assert not any(r.key == "0/tap/model.layers.0.linear_attn.v" for r in report.results)
    assert any("vvv.raw" in u for u in report.unknown) and any("garbage.raw" in u for u in report.unknown)
    assert any("notes.txt" in u for u in report.unknown) and report.failed == []
    (tmp_path / "map.json").write_text(json.dumps({"model.layers.0.linear_attn.v": "vvv"}))
    report = compare(bundle, read_dump(d, bundle, mapping=read_mapping(tmp_path / "map.json")))
    assert _status(report, "0/tap/model.layers.0.linear_attn.v").status == "pass"


def test_damaged_dump_reports_by_name_and_compares_the_rest(case, tmp_path):
    model, bundle, root, clean = case
    d = _copy(clean, tmp_path / "dump")
    r0 = d / "Result_0"
    data = (r0 / "model.layers.1.mlp.hidden.raw").read_bytes()
    (r0 / "model.layers.1.mlp.hidden.raw").write_bytes(data[:-7])                  # truncated
    (r0 / "recurrent_state_0_out.raw").unlink()                                     # missing output
    (r0 / "model.layers.2.mlp.up_proj.raw").unlink()
    np.save(r0 / "model.layers.2.mlp.up_proj.npy", np.zeros((3, 5), np.float32))     # wrong shape
    a = np.fromfile(r0 / "model.layers.2.input_layernorm.raw", np.float32)
    a[3], a[5] = np.nan, np.inf
    a.tofile(r0 / "model.layers.2.input_layernorm.raw")                             # NaN / Inf
    report = compare(bundle, read_dump(d, bundle))
    hidden = _status(report, "0/tap/model.layers.1.mlp.hidden")
    assert hidden.status == "error" and "truncated" in hidden.problem and "mlp.hidden" in hidden.problem
    assert _status(report, "0/output/recurrent_state_0_out").status == "missing"
    up = _status(report, "0/tap/model.layers.2.mlp.up_proj")
    assert up.status == "error" and "shape [3, 5]" in up.problem
    ln = _status(report, "0/tap/model.layers.2.input_layernorm")
    assert ln.status == "fail" and ln.metrics["n_nan"] == 1 and ln.metrics["n_inf"] == 1
    others = [r for r in report.results if r.status not in ("error", "missing") and r.key != ln.key]
    assert len(others) > 200 and all(r.status == "pass" for r in others)
    assert report.exit_code == 1


def test_corrupt_containers(case, tmp_path):
    model, bundle, root, _ = case
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(Exception, match="bad.npz"):
        read_dump(bad, bundle)
    st = tmp_path / "cut.safetensors"
    data = (bundle.path / "bundle.safetensors").read_bytes()
    st.write_bytes(data[:len(data) // 2])
    report = compare(bundle, read_dump(st, bundle))
    errors = [r for r in report.results if r.status == "error"]
    assert errors and all("truncated" in r.problem for r in errors)
    assert any(r.status == "pass" for r in report.results)
    with pytest.raises(InputError, match="no file of the dump"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "x.raw").write_bytes(b"1234")
        read_dump(tmp_path / "empty", bundle)


def test_raw_dump_dtype_hint(case, tmp_path):
    model, bundle, root, clean = case
    d = _copy(clean, tmp_path / "dump")
    a = np.fromfile(d / "Result_0" / "logits.raw", np.float32)
    a.astype(np.float16).tofile(d / "Result_0" / "logits.raw")
    report = compare(bundle, read_dump(d, bundle))
    logits = _status(report, "0/output/logits")
    assert logits.status == "error" and "float16" in logits.problem
    report = compare(bundle, read_dump(d, bundle, dtype="float16"))  # every raw file read as fp16 now
    assert _status(report, "0/output/logits").status in ("pass", "fail")


# ------------------------------------------------------------------------------------------------ judging

def test_policy_overrides_and_rejudge_roundtrip(case, tmp_path):
    model, bundle, root, _ = case
    dump = F.device_dump(model, PROMPT, PARAMS, 1, tmp_path / "fp16", F.fp16_round("model.layers.1.mlp.down_proj"))
    report = compare(bundle, read_dump(dump, bundle))
    assert report.first_divergence[0] == "0/tap/model.layers.1.mlp.down_proj"
    save_metrics(report, tmp_path / "m.json")
    again = rejudge(load_metrics(tmp_path / "m.json"), load_policy())
    assert [r.status for r in again.results] == [r.status for r in report.results]
    assert again.first_divergence == report.first_divergence
    relaxed = rejudge(load_metrics(tmp_path / "m.json"), load_policy(dtype="fp16"))
    assert relaxed.failed == [] and relaxed.exit_code == 0     # fp16 rounding is within fp16 thresholds
    (tmp_path / "p.json").write_text(json.dumps({"tensors": [{"match": r"\.mlp\.", "max_nmse": 1e-6}],
                                                "ignore": ["^model\\.layers\\.[23]"]}))
    custom = rejudge(load_metrics(tmp_path / "m.json"), load_policy(tmp_path / "p.json"))
    mlp = _status(custom, "0/tap/model.layers.1.mlp.down_proj")
    assert mlp.status == "pass"
    assert _status(custom, "0/tap/model.layers.1").status == "fail"  # block output still at the fp32 bar
    (tmp_path / "bad.json").write_text(json.dumps({"tensors": [{"match": "x", "max_nmse": "big"}]}))
    with pytest.raises(InputError, match="must be a number"):
        load_policy(tmp_path / "bad.json")
    with pytest.raises(InputError, match="unknown key"):
        make_policy({"tolerance": 1})


def test_three_way_judging(case, tmp_path):
    """Judged against an emulated run: the honest fp16-MLP run is the emulation itself and passes; a q_norm
    fault on top of it still fails."""
    model, bundle, root, _ = case
    fault = F.fp16_round("model.layers.1.mlp.down_proj")
    with fault:
        emulated = write_golden(tmp_path / "emulated", model, PROMPT, source="x", convention="genie",
                                params=PARAMS, decode_steps=1, taps=".")
    emulated = read_bundle(emulated)
    honest = F.device_dump(model, PROMPT, PARAMS, 1, tmp_path / "honest", F.fp16_round("model.layers.1.mlp.down_proj"))
    assert compare(bundle, read_dump(honest, bundle)).exit_code == 1        # fp32 bar: flagged
    report = compare(bundle, read_dump(honest, bundle), emulated=emulated)
    assert report.failed == []
    _, arrays = F.model_and_arrays("tiny-qwen3.5", vocab_size=2048, eos_token_id=2000)
    faulty = F.perturbed_weights(model, arrays, "model.layers.3.self_attn.q_norm.weight")
    dump = F.device_dump(faulty, PROMPT, PARAMS, 1, tmp_path / "faulty", F.fp16_round("model.layers.1.mlp.down_proj"))
    report = compare(bundle, read_dump(dump, bundle), emulated=emulated)
    assert report.first_divergence[0] == "0/tap/model.layers.3.self_attn.q_norm"
    # another case is refused; a case whose emulated decode picked other tokens is judged by the defaults there
    other = read_bundle(write_golden(tmp_path / "other", model, PROMPT[:-1] + [5], source="x", convention="genie",
                                     params=PARAMS, decode_steps=1, taps="."))
    with pytest.raises(InputError, match="prompt differ"):
        compare(bundle, read_dump(honest, bundle), emulated=other)
    flipped = read_bundle(emulated.path)
    flipped.manifest["steps"][-1]["tokens"] = [int(flipped.manifest["steps"][-1]["tokens"][0]) + 1]
    assert check_same_case(bundle, flipped) == [bundle.steps - 1]
    report = compare(bundle, read_dump(honest, bundle), emulated=flipped)
    assert any("other tokens" in n for n in report.notes)
    assert all(r.reference is None for r in report.results if r.step == bundle.steps - 1)


# ------------------------------------------------------------------------------------------------ CLI

def test_cli_exit_codes_json_and_html(case, tmp_path, capsys):
    model, bundle, root, clean = case
    assert main(["diff", str(bundle.path), str(clean)]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["diff", str(bundle.path), str(bundle.path)]) == 0   # a bundle against itself: native dtypes
    out = capsys.readouterr().out
    assert "PASS" in out and "unknown file" not in out
    dump = F.device_dump(model, PROMPT, PARAMS, 1, tmp_path / "rope", F.interleaved_rope())
    html = tmp_path / "report.html"
    assert main(["diff", str(bundle.path), str(dump), "--json", str(tmp_path / "m.json"), "--html", str(html)]) == 1
    out = capsys.readouterr().out
    assert "first divergence, step 0: model.layers.3.self_attn.q_rope" in out and "MISMATCH" in out
    assert main(["diff", str(bundle.path), "--rejudge", str(tmp_path / "m.json"), "--dtype", "bf16"]) == 1
    text = html.read_text()
    assert text.count("<img") == 5 and "model.layers.3.self_attn.q_rope" in text   # 5: the fault's scatter
    assert "fault: <b>permutation: RoPE over interleaved pairs" in text and "fault: permutation: RoPE" in out
    for argv, what in ((["diff", str(bundle.path), str(tmp_path / "nowhere")], "no such dump"),
                       (["diff", str(bundle.path), str(clean), "--dtype", "fp8"], "dtype"),
                       (["diff", str(bundle.path), str(clean), "--layout", "x=sideways"], "layout"),
                       (["diff", str(tmp_path), str(clean)], "manifest.json"),
                       (["replay", str(bundle.path), str(clean), "--layer", "9", "--model", "tiny-qwen3.5"], "")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("refimpl: error:") and what in err and err.count("\n") == 1
    assert not list(tmp_path.glob(".*tmp*"))


def test_html_report_renders_in_headless_chromium(case, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (make test installs it)")
    model, bundle, root, _ = case
    dump = F.device_dump(model, PROMPT, PARAMS, 1, tmp_path / "conv", F.conv_state_shifted())
    html = tmp_path / "report.html"
    assert main(["diff", str(bundle.path), str(dump), "--html", str(html)]) == 1
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    # the DOM after load: every plot decoded (naturalWidth > 0), reported by a script into the title
    probe = tmp_path / "probe.html"
    probe.write_text(html.read_text().replace(
        "</body>", "<script>window.onload=()=>{const i=[...document.images];document.title='plots:'+"
                   "i.filter(x=>x.complete&&x.naturalWidth>100).length+'/'+i.length}</script></body>"))
    dom = subprocess.run([chromium, *flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert "<title>plots:5/5</title>" in dom   # with the scatter of the first divergence (its fault)
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", "--window-size=1000,1600", html.as_uri()],
                   capture_output=True, timeout=120)
    import matplotlib.image as mpimg  # lazy: matplotlib is heavy, and only this test reads an image
    img = mpimg.imread(shot)
    assert img.shape[0] >= 1000 and len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 50  # not blank


# ------------------------------------------------------------------------------------------------ explain

def test_explain_rms_norm_element(case):
    model, bundle, root, _ = case
    text = explain(bundle, model, "model.layers.3.self_attn.q_norm[0,1,2,5]", step=0)
    golden = bundle.tensor(0, "tap", "model.layers.3.self_attn.q_norm")[0, 1, 2, 5]
    assert "op: rms_norm (layer 3)" in text and "sum x^2 over 32 = exact sum of 32 products" in text
    assert "(1 + w[5]" in text and text.count("reproduced bit for bit") == 1, text
    assert np.float32(text.split("y = nu * (1 + w[5] = ")[1].split(") = ")[1].split()[0]) == golden
    # a projection and an attention score, from their printed inputs: the exact sum rounded once, bit for bit
    for spec, step in (("model.layers.3.self_attn.q_proj[0,1,7]", 0),
                       ("model.layers.2.linear_attn.in_proj_qkv[0,2,9]", 0),
                       ("model.layers.3.self_attn.attn_scores[0,1,2,0]", 0),
                       ("model.layers.3.self_attn.attn_scores[0,1,2,14]", 1),
                       ("lm_head[0,3,17]", 1)):
        text = explain(bundle, model, spec, step=step)
        assert "float32 rounding (nearest, ties to even)" in text and "reproduced bit for bit" in text, (spec, text)
    text = explain(bundle, model, "model.layers.3.self_attn.attn_probs[0,1,2,14]", step=1)
    assert "softmax" in text and "p = exp" in text
    text = explain(bundle, model, "model.layers.3.self_attn.q_rope[0,3,0,1]", step=0)
    assert "partner x[d=" in text and "cos =" in text
    with pytest.raises(InputError, match="does not fit"):
        explain(bundle, model, "model.layers.3.self_attn.q_norm[0,9,2,5]")
    with pytest.raises(InputError, match="expected NAME"):
        explain(bundle, model, "q_norm(1)")


def test_cli_damaged_dump_missing_outputs_and_unwritable_outputs(case, tmp_path, capsys):
    model, bundle, root, clean = case
    d = _copy(clean, tmp_path / "dump")
    data = (d / "Result_0" / "model.embed_tokens.raw").read_bytes()
    (d / "Result_0" / "model.embed_tokens.raw").write_bytes(data[:-4])   # the first tensor: unreadable
    html = tmp_path / "r.html"
    assert main(["diff", str(bundle.path), str(d), "--html", str(html)]) == 1
    out = capsys.readouterr().out
    assert "first divergence, step 0: model.embed_tokens" in out and "truncated" in out and html.exists()
    d2 = _copy(clean, tmp_path / "dump2")
    (d2 / "Result_1" / "logits.raw").unlink()
    assert main(["diff", str(bundle.path), str(d2)]) == 1
    assert "INCOMPLETE" in capsys.readouterr().out
    json_out = tmp_path / "m.json"
    assert main(["diff", str(bundle.path), str(clean), "--json", str(json_out), "--html",
                 str(tmp_path / "nowhere" / "r.html")]) == 2
    assert "nowhere" in capsys.readouterr().err and not json_out.exists()


def test_policy_mistakes_are_errors(tmp_path):
    for spec, what in (({"ignore": "abc"}, "'ignore' a list"), ({"layouts": ["a"]}, "'layouts' an object"),
                       ({"three_way_k": "x"}, "three_way_k"), ({"three_way_k": 0}, "three_way_k"),
                       ({"tensors": [{"match": ".", "max_nmsee": 1}]}, "known metric"),
                       ({"tensors": [{"match": "(", "max_nmse": 1}]}, "bad regex")):
        with pytest.raises(InputError, match=what):
            make_policy(spec)


def test_atol_floor_only_for_a_golden_near_zero():
    rng = np.random.default_rng(0)
    g = rng.normal(0, 0.02, 1000)                                   # small but not ~0: NMSE decides
    m = tensor_metrics(g, g + rng.normal(0, 0.003, 1000), dtype="bf16")
    assert judge(m, None, {"max_nmse": 1e-4, "atol": 1e-2})           # 17 dB: fails despite max abs < atol
    z = np.zeros(1000)
    m = tensor_metrics(z, z + 1e-3, dtype="bf16")
    assert not judge(m, None, {"max_nmse": 1e-4, "atol": 1e-2})       # a zero golden: within the floor


def test_rejudge_keeps_the_measured_dtype(case, tmp_path, capsys):
    model, bundle, root, _ = case
    dump = F.device_dump(model, PROMPT, PARAMS, 1, tmp_path / "fp16", F.fp16_round("model.layers.1.mlp.down_proj"))
    assert main(["diff", str(bundle.path), str(dump), "--dtype", "fp16", "--json", str(tmp_path / "m.json")]) == 0
    assert main(["diff", str(bundle.path), "--rejudge", str(tmp_path / "m.json")]) == 0   # still fp16
    assert main(["diff", str(bundle.path), "--rejudge", str(tmp_path / "m.json"), "--dtype", "fp32"]) == 1
    shutil.rmtree(tmp_path / "fp16")
    capsys.readouterr()


@pytest.mark.parametrize("convention", ["hf", "qeff"])
def test_float64_bundles_compare_without_overflow(convention, tmp_path):
    model, arrays = F.model_and_arrays("tiny-qwen3.5", vocab_size=2048, eos_token_id=2000)
    m64 = Model(model.config, Weights(arrays, dtype="float64"))
    params = {} if convention == "hf" else {"seq_len": 4, "ctx_len": 16}
    golden = read_bundle(write_golden(tmp_path / "g", m64, PROMPT, source="x", convention=convention, params=params,
                                      decode_steps=1, taps="."))
    for m, name in ((m64, "d64"), (model, "d32")):
        dump = read_dump(F.device_dump(m, PROMPT, params, 1, tmp_path / name, convention=convention), golden)
        with np.errstate(over="raise", invalid="raise"):  # finfo(float64).min masks must not overflow the sums
            report = compare(golden, dump)
        assert report.exit_code == 0


def test_three_way_bar_and_an_explicit_rule():
    policy = make_policy({"three_way_k": 2, "tensors": [{"match": "down_proj$", "max_nmse": 1e-3}]})
    ref = {"nmse": 1e-6}
    assert policy.criteria("model.layers.0.mlp.up_proj", False, ref)["max_nmse"] == pytest.approx(4e-6)
    assert policy.criteria("model.layers.0.mlp.down_proj", False, ref)["max_nmse"] == 1e-3   # the rule wins
    assert policy.criteria("x", False, {"nmse": 0.0})["max_nmse"] == pytest.approx(4e-8)     # floor: the fp32 bar
    # a reduced-precision device never has to beat k^2 x one rounding to its dtype (u^2 / 3, fp16 u = 2^-11)
    fp16 = make_policy({"three_way_k": 2}, "fp16")
    assert fp16.criteria("x", False, {"nmse": 1e-12})["max_nmse"] == pytest.approx(4 * 2.0 ** -22 / 3)
    assert fp16.criteria("x", False, {"nmse": 1e-6})["max_nmse"] == pytest.approx(4e-6)
    # an integer tensor three-way: equal to the golden or, element by element, to the emulation
    assert fp16.criteria("sel", True, {"equals_golden_or_emulation": True}).get("exact") is None
    assert fp16.criteria("sel", True, {"equals_golden_or_emulation": False})["exact"] is True


def test_default_bar_judges_a_step_against_the_tensors_power_over_the_run():
    """A decode step's one-element gate logit may sit near 0 (a cancelling sum): its honest inherited error is
    relative to the op's usual scale, so the default bar divides by the run's power when that is larger. The
    same absolute error on a tensor at its usual scale, and a fault's error, are judged as before; a bar a
    policy sets is on the step's own nmse."""
    golden, honest, faulty = np.float32([8.8e-4]), np.float32([8.8e-4 + 3.6e-6]), np.float32([8.8e-4 + 3.6e-3])
    run_power = 0.05 ** 2                                  # the tap's mean square over every step of the run
    policy = make_policy()
    crit = policy.criteria("model.layers.2.mlp.shared_expert_gate", False)
    for device, fails in ((honest, False), (faulty, True)):
        m = tensor_metrics(golden, device)
        assert judge(m, None, crit) != []                  # alone, the step's nmse fails (1.7e-5 > 1e-8)
        m["run_power"] = run_power
        assert bool(judge(m, None, crit)) is fails
        assert judged_nmse(m) == pytest.approx(m["mse"] / run_power)
    m = {**tensor_metrics(np.float32([0.05]), np.float32([0.05 + 3.6e-6])), "run_power": run_power}
    assert judged_nmse(m) == m["nmse"]                     # at its usual scale: the step's own power
    strict = make_policy({"tensors": [{"match": "gate", "max_nmse": 1e-8}]})
    m = {**tensor_metrics(golden, honest), "run_power": run_power}
    assert judge(m, None, strict.criteria("model.layers.2.mlp.shared_expert_gate", False)) != []
    three_way = policy.criteria("x", False, {"nmse": 1e-9})
    assert "run_power" not in three_way                    # three-way compares per-step nmse with per-step nmse
