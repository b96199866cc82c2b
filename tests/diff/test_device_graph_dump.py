"""`refimpl diff` of a quantised device graph's run, as its engineer has it (issue 27): the golden written with a QDQ
model's quantisers (`refimpl golden --encodings model_qdq.onnx`), the dump named as the device graph names its
tensors (each quantiser's integer codes under its QuantizeLinear's output, the graph outputs as floats), and
`refimpl diff Q DUMP --float F --encodings model_qdq.onnx` mapping the names to refimpl's taps by the bundle's record.

The device is ONNX Runtime's CPU EP running the committed fixture (tests/fixtures/quantised/tiny-qwen3-qdq.onnx, a
W8A16 QDQ model of tiny-qwen3 with vocabulary 256; the weights tests/e2e/devices.small_preset seeds) on the golden's
own inputs: an implementation we did not write. Cost ~5 s."""

import json
from pathlib import Path

import numpy as np
import pytest

from refimpl.bundle import read_bundle
from refimpl.cli import main
from refimpl.formats.qdq import qdq_names, read_qdq
from refimpl.golden import write_golden
from refimpl.models.config import config_from_dict
from refimpl.models.model import Model
from refimpl.precision import Policy, policy
from refimpl.presets import PRESETS, random_weights

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

FIXTURE = Path(__file__).parent.parent / "fixtures" / "quantised" / "tiny-qwen3-qdq.onnx"
PROMPT = [170, 127, 102, 53, 61, 8, 15, 3]          # the fixture's calibration input (tiny-qwen3-qdq-inputs.npz)
GENIE = {"ar": 8, "cl": 32}                         # its export's call (mask floor -100, the default)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(float golden, quantised golden, the CPU EP's dump, its raw values by ONNX name) of the fixture."""
    root = tmp_path_factory.mktemp("device-graph")
    cfg = config_from_dict({**PRESETS["tiny-qwen3"], "vocab_size": 256, "eos_token_id": 208, "bos_token_id": 207})
    arrays = random_weights(cfg, seed=11)                            # devices.small_preset(vocab=256)'s weights
    arrays["model.embed_tokens.weight"] = arrays["model.embed_tokens.weight"] * np.float32(0.05)
    q_model = Model.from_arrays(cfg, arrays, "e2e", Policy(weights="encodings", encodings=str(FIXTURE)),
                                device=read_qdq(FIXTURE))
    f = write_golden(root / "f", Model.from_arrays(cfg, arrays, "e2e", policy("float32")), PROMPT, source="e2e",
                     convention="genie", params=GENIE, taps=".")
    q = write_golden(root / "q", q_model, PROMPT, source="e2e", convention="genie", params=GENIE, taps=".",
                     codes=True)
    m = onnx.load(FIXTURE)
    codes = [n.output[0] for n in m.graph.node if n.op_type == "QuantizeLinear" and n.output[0] not in
             {o.name for o in m.graph.output}]
    for name in codes:
        m.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.graph_optimization_level = 1, ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
    bundle = read_bundle(q)
    feed = {i.name: bundle.tensor(0, "inputs", i.name) for i in session.get_inputs()}   # the golden's own inputs
    names = [o.name for o in session.get_outputs()]
    values = dict(zip(names, session.run(names, feed)))
    dump = root / "dump"
    dump.mkdir()
    for name, v in values.items():
        np.save(dump / f"{name}.npy", v)
    return f, q, dump, values


def diff(f, q, dump, out, *extra):
    code = main(["diff", str(q), str(dump), "--float", str(f), "--encodings", str(FIXTURE), "--json", str(out),
                 "-q", *extra])
    return code, json.loads(Path(out).read_text()) if Path(out).exists() else None


def test_the_cpu_eps_run_named_as_its_qdq_graph_names_it_is_explained_by_quantisation(run, tmp_path):
    """Every tap a quantiser sits on is read from the QuantizeLinear output named after it (no mapping file), its
    codes decoded with the tap's encoding (q_rope's [B, H, T, D], attn_output's [B, H, T, D] heads read in refimpl's
    layout): every compared tensor explained, the first excess none."""
    f, q, dump, _ = run
    code, report = diff(f, q, dump, tmp_path / "m.json")
    statuses = {r["name"]: r["status"] for r in report["results"]}
    assert code == 0 and set(statuses.values()) == {"pass"}, {k: v for k, v in statuses.items() if v != "pass"}
    taps = {r["tap"] for r in read_bundle(q).manifest["quantisation"]["quantisers"] if r["io"] == "output"}
    assert len(taps) > 60 and taps <= set(statuses), sorted(taps - set(statuses))[:5]
    assert {"model.layers.0.self_attn.q_rope", "model.layers.1.self_attn.attn_output", "logits"} <= set(statuses)
    assert report["first_divergence"]["0"] is None


def offset_dump(q, values, root) -> Path:
    """The CPU EP's dump with the codes of layer 1's attention residual add one step up (an activation offset off
    by one), under its QuantizeLinear's output name."""
    tensor = next(r["onnx"][-1] for r in read_bundle(q).manifest["quantisation"]["quantisers"]
                  if r.get("tap") == "model.layers.1.attn_residual")
    alias = next(a for a, t in qdq_names(FIXTURE).items() if t == tensor and a in values)
    faulty = root / "dump"
    faulty.mkdir()
    for name, v in values.items():
        np.save(faulty / f"{name}.npy", np.minimum(v.astype(np.int64) + 1, 65535).astype(v.dtype)
                if name == alias else v)
    return faulty


def test_a_tap_one_code_off_is_the_first_excess(run, tmp_path):
    """The device's codes of one residual add one step off (an activation offset off by one): the first excess
    beyond quantisation is that tap; everything before it stays explained."""
    f, q, dump, values = run
    faulty = offset_dump(q, values, tmp_path)
    code, report = diff(f, q, faulty, tmp_path / "m.json")
    assert code == 1 and report["first_divergence"]["0"] == "0/tap/model.layers.1.attn_residual"
    before = [r for r in report["results"] if r["name"].startswith("model.layers.0.")]
    assert before and all(r["status"] == "pass" for r in before)
    hit = next(r for r in report["results"] if r["key"] == report["first_divergence"]["0"])
    excess = (hit["metrics"]["nmse"] / hit["reference"]["nmse"]) ** 0.5
    assert excess < 0.01 and any("codes shifted by +1 at 99.8 %" in f for f in hit["failures"]), hit["failures"]
    assert hit["fault"]["class"] == "offset" and hit["fault"]["params"]["codes"] == 1, hit["fault"]


def test_the_code_shift_criterion_is_the_policys_and_rejudge_applies_it(run, tmp_path):
    """The offset's verdict and class come from the tap's saved metrics (metrics["code_shift"], judged by the
    policy's code_shift criterion): `refimpl diff --rejudge` of the saved metrics gives the same statuses, first
    excess and fault; a policy that switches the criterion off passes the tap, on the dump and on re-judging."""
    f, q, dump, values = run
    faulty = offset_dump(q, values, tmp_path)
    key = "0/tap/model.layers.1.attn_residual"
    code, report = diff(f, q, faulty, tmp_path / "m.json")
    hit = next(r for r in report["results"] if r["key"] == key)
    assert hit["metrics"]["code_shift"]["codes"] == 1 and hit["bar"]["code_shift"] == {"max_share": 0.5,
                                                                                      "min_codes": 64}, hit
    assert main(["diff", str(q), "--rejudge", str(tmp_path / "m.json"), "--json", str(tmp_path / "r.json"),
                 "-q"]) == 1
    again = json.loads((tmp_path / "r.json").read_text())
    assert again["first_divergence"] == report["first_divergence"] == {"0": key}
    assert {r["key"]: r["status"] for r in again["results"]} == {r["key"]: r["status"] for r in report["results"]}
    redo = next(r for r in again["results"] if r["key"] == key)
    assert redo["fault"] == hit["fault"] and redo["fault"]["class"] == "offset" and redo["failures"] == hit["failures"]
    off = tmp_path / "off.json"
    off.write_text(json.dumps({"three_way_k": 0.01, "tensors": [{"match": r"attn_residual$", "code_shift": False}]}))
    code, passed = diff(f, q, faulty, tmp_path / "p.json", "--policy", str(off))
    assert code == 0 and passed["first_divergence"] == {"0": None}
    assert next(r for r in passed["results"] if r["key"] == key)["status"] == "pass"
    assert main(["diff", str(q), "--rejudge", str(tmp_path / "m.json"), "--policy", str(off), "--json",
                 str(tmp_path / "o.json"), "-q"]) == 0
    rejudged = json.loads((tmp_path / "o.json").read_text())
    redo = next(r for r in rejudged["results"] if r["key"] == key)
    assert rejudged["first_divergence"] == {"0": None} and redo["status"] == "pass" and redo["fault"] is None


def test_a_malformed_saved_code_shift_is_one_line_error(run, tmp_path, capsys):
    f, q, dump, values = run
    code, report = diff(f, q, offset_dump(q, values, tmp_path), tmp_path / "m.json")
    hit = next(r for r in report["results"] if "code_shift" in (r["metrics"] or {}))
    for bad in ({"codes": 1.5, "share": 1.0, "n": 64}, {"codes": 1, "share": 2, "n": 64}, {"codes": 1, "share": 1},
                [1, 1.0, 64], {"codes": 1, "share": 1.0, "n": 64, "zero_point": 3}):
        hit["metrics"]["code_shift"] = bad
        (tmp_path / "bad.json").write_text(json.dumps(report))
        assert main(["diff", str(q), "--rejudge", str(tmp_path / "bad.json"), "-q"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "code_shift" in err, err


def test_another_qdq_model_than_the_bundles_is_one_line_error(run, tmp_path, capsys):
    f, q, dump, _ = run
    other = tmp_path / "other_qdq.onnx"
    other.write_bytes(FIXTURE.read_bytes() + b"\0")
    assert main(["diff", str(q), str(dump), "--float", str(f), "--encodings", str(other), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "differs from the bundle's encodings" in err


def test_code_shift_needs_most_codes_shifted_alike_and_enough_codes():
    from refimpl.diff.metrics import code_shift
    from refimpl.diff.policy import CODE_SHIFT, judge, make_policy, shifted_codes
    n = CODE_SHIFT["min_codes"]
    want = np.arange(n, dtype=np.int64)
    on = make_policy().criteria("t", False, {"nmse": 1.0})                    # three-way: the criterion is on
    assert on["code_shift"] == CODE_SHIFT and "code_shift" not in make_policy().criteria("t", False)
    assert code_shift(want, want + 1) == {"codes": 1, "share": 1.0, "n": n}
    assert shifted_codes({"code_shift": code_shift(want, want + 1)}, on)["codes"] == 1
    assert code_shift(want, want) == {"codes": 0, "share": 0.0, "n": n}       # every code agrees
    assert shifted_codes({"code_shift": code_shift(want[:-1], want[:-1] + 1)}, on) is None   # too few codes to tell
    half = want + (np.arange(want.size) % 2)                                  # half shifted: not a majority
    assert code_shift(want, half)["share"] == 0.5 and shifted_codes({"code_shift": code_shift(want, half)}, on) is None
    assert shifted_codes({}, on) is None                                      # floats dumped: no codes to judge
    metrics = {"n": n, "max_abs": 0.1, "n_nan": 0, "n_inf": 0, "nmse": 1e-6, "code_shift": code_shift(want, want - 3)}
    assert judge(metrics, None, on, {"nmse": 1e-4}) == [
        "codes shifted by -3 at 100.0 % of elements: the device's zero point is not its encoding's (excess 0.1 alone "
        "is within the bar)"]
    off = make_policy({"tensors": [{"match": ".", "code_shift": False}]}).criteria("t", False, {"nmse": 1e-4})
    loose = make_policy({"tensors": [{"match": ".", "code_shift": {"min_codes": n + 1}}]})
    assert judge(metrics, None, off) == [] and judge(metrics, None, loose.criteria("t", False, {"nmse": 1e-4})) == []


def test_an_unreadable_tap_as_first_divergence_is_reported_not_a_crash(run, tmp_path, capsys):
    """A dumped tap the diff cannot read (here the embedding's codes in a shape of another size) is an error row;
    as the first divergence the three-way report names it (excess none) instead of failing to print."""
    f, q, dump, values = run
    broken = tmp_path / "dump"
    broken.mkdir()
    alias = next(a for a, t in qdq_names(FIXTURE).items() if t == "embedding" and a in values)
    for name, v in values.items():
        np.save(broken / f"{name}.npy", v[..., :-1] if name == alias else v)
    code, report = diff(f, q, broken, tmp_path / "m.json", "--top", "3")
    out = capsys.readouterr().out
    assert code == 1 and report["first_divergence"]["0"] == "0/tap/model.embed_tokens"
    assert "first excess beyond quantisation, step 0: model.embed_tokens" in out and "excess none: error" in out
