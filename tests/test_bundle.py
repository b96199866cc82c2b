"""Golden bundle writer / reader: round trip, input_list.txt, verification, atomicity, exports, AIMET layout."""

import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import ml_dtypes
import numpy as np
import pytest

from refimpl.bundle import SCHEMA_VERSION, Tensor, read_bundle, valid_mask, write_bundle
from refimpl.errors import FormatError, InputError
from refimpl.formats.safetensors import read_safetensors

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.int32, np.int64, np.uint16, np.uint8, np.int8,
          np.bool_]


def _array(rng, dtype, shape):
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) < 0.5
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


def _steps(rng, n_steps=2):
    """Genie-like steps: two inputs, one KV output with a valid box, a 4-D tap, every dtype as a tap."""
    steps = []
    for k in range(n_steps):
        step = [Tensor("input_ids", "input", rng.integers(0, 100, (1, 4), dtype=np.int32), "b,t"),
                Tensor("attention_mask", "input", rng.standard_normal((1, 1, 4, 8)).astype(np.float32), "b,1,t,s"),
                Tensor("logits", "output", rng.standard_normal((1, 4, 16)).astype(np.float32), "b,t,v"),
                Tensor("past_key_0_out", "output", rng.standard_normal((2, 1, 8, 4)).astype(np.float16), "kvh,b,d,t",
                       valid=[[[0, 2], [0, 1], [0, 8], [1, 4]]], meta={"layer": 0}),
                Tensor("model.layers.0.self_attn.attn_probs", "tap", rng.random((1, 2, 4, 8)).astype(np.float32),
                       "b,h,t,s", meta={"layer": 0, "op": "softmax"})]
        step += [Tensor(f"dtype_{np.dtype(d).name}", "tap", _array(rng, d, (3, 5))) for d in DTYPES]
        step.append(Tensor("scalar", "tap", np.float32(k + 0.5)))
        steps.append(step)
    return steps


MANIFEST = {"model": {"hf_id": "tiny"}, "convention": {"name": "genie", "AR": 4, "CL": 8}, "prompt_ids": [1, 2, 3]}


@pytest.fixture
def bundle_dir(tmp_path, rng):
    steps = _steps(rng)
    return write_bundle(tmp_path / "case", MANIFEST, steps, exports=("safetensors", "npz"), aimet=True), steps


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_round_trip_names_shapes_dtypes_values(bundle_dir):
    path, steps = bundle_dir
    b = read_bundle(path)
    assert b.steps == len(steps) and b.path == path
    for k, step in enumerate(steps):
        for t in step:
            got = b.tensor(k, t.role, t.name)
            want = np.asarray(t.array)
            assert got.dtype == want.dtype and got.shape == want.shape, (k, t.name)
            assert got.tobytes() == want.tobytes(), (k, t.name)  # bit-exact, NaN-safe
    assert b.tensor(0, "outputs", "logits").shape == (1, 4, 16)   # plural role spelling accepted
    assert b.manifest["schema_version"] == SCHEMA_VERSION and b.manifest["refimpl_version"]
    assert b.manifest["convention"] == MANIFEST["convention"] and b.manifest["prompt_ids"] == [1, 2, 3]
    names = {r: [t.name for t in steps[0] if t.role == r] for r in ("input", "output", "tap")}
    assert b.manifest["steps"][1] == {"index": 1, "inputs": names["input"], "outputs": names["output"],
                                      "taps": names["tap"]}
    # execution order: per step inputs, taps, outputs, each in the order given
    assert [(r["step"], r["name"]) for r in b.records()] == [
        (k, n) for k in range(len(steps)) for role in ("input", "tap", "output") for n in names[role]]
    rec = b.manifest["tensors"]["0/output/past_key_0_out"]
    assert rec["file"] == "steps/0/outputs/past_key_0_out.raw" and rec["dtype"] == "float16"
    assert rec["shape"] == [2, 1, 8, 4] and rec["axes"] == "kvh,b,d,t" and rec["meta"] == {"layer": 0}
    assert b.manifest["tensors"]["1/tap/dtype_bfloat16"]["dtype"] == "bfloat16"
    assert (path / "steps/1/taps/dtype_bfloat16.raw").stat().st_size == 15 * 2
    with pytest.raises(InputError, match="no tensor 0/output/nope"):
        b.tensor(0, "output", "nope")


def test_raw_files_are_headerless_little_endian_c_order(tmp_path):
    a = np.arange(6, dtype=">i4").reshape(2, 3).T  # big-endian, Fortran-ordered view
    path = write_bundle(tmp_path / "b", {}, [[Tensor("x", "input", a)]])
    assert (path / "steps/0/inputs/x.raw").read_bytes() == np.ascontiguousarray(a, "<i4").tobytes()
    np.testing.assert_array_equal(read_bundle(path).tensor(0, "input", "x"), a)


def test_input_list_parses_back_to_the_inputs_in_order(bundle_dir):
    path, steps = bundle_dir
    b = read_bundle(path)
    lines = (path / "input_list.txt").read_text().splitlines()
    assert lines[0] == "input_ids:=steps/0/inputs/input_ids.raw attention_mask:=steps/0/inputs/attention_mask.raw"
    parsed = b.input_list()
    assert len(parsed) == len(steps)
    for k, (line, step) in enumerate(zip(parsed, steps)):
        assert list(line) == [t.name for t in step if t.role == "input"]
        for name, rel in line.items():
            assert (path / rel).is_file()
            assert rel == b.manifest["tensors"][f"{k}/input/{name}"]["file"]
            np.testing.assert_array_equal(np.fromfile(path / rel, np.int32 if name == "input_ids" else np.float32),
                                          b.tensor(k, "input", name).ravel())


def test_flipped_byte_is_a_sha256_mismatch_naming_file_and_tensor(bundle_dir):
    path, _ = bundle_dir
    raw = path / "steps/0/outputs/logits.raw"
    data = bytearray(raw.read_bytes())
    data[5] ^= 0x01
    raw.write_bytes(data)
    b = read_bundle(path)  # sizes still right: opening succeeds, the read fails
    with pytest.raises(FormatError, match=r"steps/0/outputs/logits\.raw: sha256 mismatch \(tensor 0/output/logits\)"):
        b.tensor(0, "output", "logits")
    with pytest.raises(FormatError, match="logits.raw: sha256 mismatch"):
        b.verify()
    b.tensor(1, "output", "logits")  # other tensors still readable
    unverified = read_bundle(path, verify=False).tensor(0, "output", "logits")
    assert isinstance(unverified, np.memmap) and unverified.tobytes() == bytes(data)


def test_truncated_or_missing_file_is_a_format_error(bundle_dir):
    path, _ = bundle_dir
    raw = path / "steps/1/taps/model.layers.0.self_attn.attn_probs.raw"
    raw.write_bytes(raw.read_bytes()[:-3])
    with pytest.raises(FormatError, match=r"attn_probs\.raw: 253 bytes, expected 256 .*tensor 1/tap/model"):
        read_bundle(path)
    with pytest.raises(FormatError, match="253 bytes"):
        read_bundle(path, verify=False).tensor(1, "tap", "model.layers.0.self_attn.attn_probs")
    raw.unlink()
    with pytest.raises(FormatError, match=r"attn_probs\.raw: missing \(tensor 1/tap/"):
        read_bundle(path)


def test_corrupt_derived_file_fails_verify(bundle_dir):
    path, _ = bundle_dir
    (path / "aimet/outputs/layer_outputs_1/logits.raw").write_bytes(b"\0" * 256)
    read_bundle(path)  # raw files intact
    with pytest.raises(FormatError, match="layer_outputs_1/logits.raw: sha256 mismatch"):
        read_bundle(path).verify()


def test_manifest_checked_on_read(bundle_dir):
    path, _ = bundle_dir
    mf = path / "manifest.json"
    m = json.loads(mf.read_text())
    mf.write_text(json.dumps(m | {"schema_version": 99}))
    with pytest.raises(FormatError, match="schema_version 99"):
        read_bundle(path)
    m["tensors"]["0/output/logits"]["file"] = "../../etc/passwd"
    mf.write_text(json.dumps(m))
    with pytest.raises(FormatError, match="0/output/logits.*file '../../etc/passwd', expected steps/0/outputs/logits"):
        read_bundle(path)
    mf.write_text("{not json")
    with pytest.raises(FormatError, match="manifest.json: not valid JSON"):
        read_bundle(path)
    with pytest.raises(FormatError, match="nowhere: no such directory"):
        read_bundle(path.parent / "nowhere")
    (path.parent / "empty").mkdir()
    with pytest.raises(FormatError, match="manifest.json: missing"):
        read_bundle(path.parent / "empty")


@pytest.mark.parametrize("name", ["past-key", "a:b", "a/b", "", "with space", "../x"])
def test_bad_names_are_input_errors(tmp_path, name):
    with pytest.raises(InputError, match="only \\[A-Za-z0-9_.\\]"):
        write_bundle(tmp_path / "b", {}, [[Tensor(name, "input", np.zeros(2, np.float32))]])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tensor, kwargs, match", [
    (Tensor("x", "weight", np.zeros(2)), {}, "role 'weight'"),
    (Tensor("x", "tap", np.zeros(2, np.complex64)), {}, "dtype complex64"),
    (Tensor("x", "tap", np.zeros((2, 3)), axes="t"), {}, "axes 't' must name each of the 2 axes"),
    (Tensor("x", "tap", np.zeros((2, 3)), valid=[[[0, 2], [0, 4]]]), {},
     r"valid box \[\[0, 2\], \[0, 4\]\] does not fit"),
    (Tensor("x", "tap", np.zeros((2, 3)), valid=[[[0, 2]]]), {}, "does not fit shape"),
    (Tensor("x", "tap", np.zeros((2, 3)), valid=[[[0, 0.5], [0, 3]]]), {}, "valid must be a list of boxes"),
    (Tensor("x", "tap", np.zeros(2), meta={"f": object()}), {}, "meta: cannot be written as JSON"),
    (Tensor("x", "tap", np.zeros(2)), {"exports": ("onnx",)}, "export 'onnx'"),
])
def test_bad_tensors_and_options_are_input_errors(tmp_path, tensor, kwargs, match):
    with pytest.raises(InputError, match=match):
        write_bundle(tmp_path / "b", {}, [[tensor]], **kwargs)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("manifest, steps, match", [
    ({"schema_version": 2}, [[]], "schema_version 2"),
    ({"tensors": {}}, [[]], "'tensors' is written by write_bundle"),
    ({"steps": [{}]}, [[], []], "'steps' must be a list of 2 dicts"),
    ({"steps": [{"inputs": ["y"]}]}, [[Tensor("x", "input", np.zeros(1))]], r"steps\[0\].inputs is \['y'\]"),
    ({"ratio": float("nan")}, [[]], "manifest: cannot be written as JSON"),
    ({}, [[Tensor("x", "tap", np.zeros(1)), Tensor("x", "tap", np.ones(1))]], r"tap name\(s\) \['x'\] given more"),
])
def test_bad_manifests_are_input_errors(tmp_path, manifest, steps, match):
    with pytest.raises(InputError, match=match):
        write_bundle(tmp_path / "b", manifest, steps)
    assert list(tmp_path.iterdir()) == []


def test_same_content_gives_byte_identical_bundles(tmp_path):
    a = write_bundle(tmp_path / "a", MANIFEST, _steps(np.random.default_rng(1)), exports=("safetensors", "npz"),
                     aimet=True)
    b = write_bundle(tmp_path / "b", MANIFEST, _steps(np.random.default_rng(1)), exports=("safetensors", "npz"),
                     aimet=True)
    fa, fb = _files(a), _files(b)
    assert len(fa) > 40 and fa.keys() == fb.keys()
    assert [k for k in fa if fa[k] != fb[k]] == []
    c = write_bundle(tmp_path / "c", MANIFEST, _steps(np.random.default_rng(2)))
    assert _files(c)["manifest.json"] != fa["manifest.json"]


def test_existing_target_needs_overwrite(tmp_path, rng):
    path = write_bundle(tmp_path / "case", {"run": 1}, _steps(rng, 1))
    before = _files(path)
    with pytest.raises(InputError, match=r"case: already exists \(pass overwrite=True"):
        write_bundle(path, {"run": 2}, _steps(rng, 1))
    assert _files(path) == before
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="file: already exists"):
        write_bundle(tmp_path / "file", {}, [[]])
    write_bundle(path, {"run": 2}, _steps(rng, 3), overwrite=True)
    assert read_bundle(path).manifest["run"] == 2 and read_bundle(path).steps == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case", "file"]  # no temp or old copy left


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("overwrite", [False, True])
def test_exception_mid_write_leaves_nothing(tmp_path, rng, exc, overwrite):
    if overwrite:
        old = _files(write_bundle(tmp_path / "case", {}, _steps(rng, 1)))

    def boom(k, total):
        assert total == 3
        if k == 1:
            raise exc("stop")

    with pytest.raises(exc):
        write_bundle(tmp_path / "case", {}, _steps(rng, 3), progress=boom, overwrite=overwrite, aimet=True)
    if overwrite:
        assert _files(tmp_path / "case") == old
        assert [p.name for p in tmp_path.iterdir()] == ["case"]
    else:
        assert list(tmp_path.iterdir()) == []


def test_progress_reports_each_step(tmp_path, rng):
    seen = []
    write_bundle(tmp_path / "b", {}, _steps(rng, 3), progress=lambda k, n: seen.append((k, n)))
    assert seen == [(0, 3), (1, 3), (2, 3)]


_SLOW_WRITER = """
import sys, time
import numpy as np
from refimpl.bundle import Tensor, write_bundle
steps = [[Tensor("x", "input", np.arange(4, dtype=np.float32))] for _ in range(3)]
write_bundle(sys.argv[1], {}, steps, progress=lambda k, n: time.sleep(60))
"""


def test_sigkill_mid_write_leaves_no_target_and_stale_temps_are_cleaned(tmp_path):
    target = tmp_path / "case"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])   # another, live writer
    live = tmp_path / f".other.tmp-{other.pid}-0123abcd"  # its temp: must survive cleanup
    live.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(target)])
    try:
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob(".case.tmp-*/steps/0/inputs/x.raw")):
            assert proc.poll() is None and time.monotonic() < deadline, "writer ended or never started"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not os.path.lexists(target)
    stale = list(tmp_path.glob(f".case.tmp-{proc.pid}-*"))
    assert len(stale) == 1
    try:
        write_bundle(tmp_path / "next", {}, [[]])
        assert not stale[0].exists() and live.is_dir()
        assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "next"]
    finally:
        other.kill()
        other.wait()


def test_safetensors_and_npz_exports_hold_the_same_arrays(bundle_dir):
    path, steps = bundle_dir
    b = read_bundle(path)
    st = read_safetensors(path / "bundle.safetensors")
    with np.load(path / "bundle.npz") as z:
        npz = {k: z[k] for k in z.files}
    keys = [f"{r['step']}/{r['role']}/{r['name']}" for r in b.records()]
    assert sorted(st) == sorted(keys) and list(npz) == keys  # npz in execution order
    for rec, key in zip(b.records(), keys):
        want = b.tensor(rec["step"], rec["role"], rec["name"])
        assert st[key].dtype == want.dtype and st[key].tobytes() == want.tobytes(), key
        got = npz[key].view(ml_dtypes.bfloat16) if rec["dtype"] == "bfloat16" else npz[key]
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), key
    assert npz["0/tap/dtype_bfloat16"].dtype == np.uint16  # bf16 bits, documented
    with open(path / "bundle.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert json.loads(header["__metadata__"]["tensors"]) == b.manifest["tensors"]
    assert all(i.date_time == (1980, 1, 1, 0, 0, 0) for i in zipfile.ZipFile(path / "bundle.npz").infolist())


def test_aimet_layout_batch_axis_and_nhwc(tmp_path, rng):
    x3 = rng.standard_normal((2, 3, 4)).astype(np.float32)      # no batch axis: [1,2,3,4] -> NHWC [1,3,4,2]
    x4 = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)   # leading "b": kept, NHWC [1,3,4,2]
    k4 = rng.standard_normal((2, 1, 3, 4)).astype(np.float16)   # "kvh,b,d,t": [1,2,1,3,4], 5-D: unchanged
    bf = rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16)  # [1,3,5] as float32
    ids = np.array([[5, 6, 7]], np.int32)
    mask = rng.standard_normal((1, 1, 3, 6)).astype(np.float32)
    steps = [[Tensor("input_ids", "input", ids, "b,t"), Tensor("mask", "input", mask, "b,1,t,s"),
              Tensor("logits", "output", bf), Tensor("past_key_0_out", "output", k4, "kvh,b,d,t"),
              Tensor("h", "tap", x3), Tensor("probs", "tap", x4, "b,h,t,s")]] * 2
    path = write_bundle(tmp_path / "b", {}, steps, aimet=True)
    aimet = path / "aimet"

    def raw(rel, dtype=np.float32):
        return np.fromfile(aimet / rel, dtype)

    for k in range(2):
        out = f"outputs/layer_outputs_{k}"
        np.testing.assert_array_equal(raw(f"{out}/h.raw"), x3[None].transpose(0, 2, 3, 1).ravel())
        assert not np.array_equal(raw(f"{out}/h.raw"), x3.ravel())  # the transpose really moved data
        np.testing.assert_array_equal(raw(f"{out}/probs.raw"), x4.transpose(0, 2, 3, 1).ravel())
        np.testing.assert_array_equal(raw(f"{out}/past_key_0_out.raw"), k4.astype(np.float32).ravel())
        np.testing.assert_array_equal(raw(f"{out}/logits.raw"), bf.astype(np.float32).ravel())
        np.testing.assert_array_equal(raw(f"inputs/input_{k}/0.raw", np.int32), ids.ravel())
        np.testing.assert_array_equal(raw(f"inputs/input_{k}/1.raw"), mask.transpose(0, 2, 3, 1).ravel())
    order = json.loads((aimet / "layer_output_name_order.json").read_text())
    assert order == {"layer_output_names": ["h", "probs", "logits", "past_key_0_out"]}
    read_bundle(path).verify()
    with pytest.raises(InputError, match="output and a tap share a name"):
        write_bundle(tmp_path / "c", {}, [[Tensor("y", "output", x3), Tensor("y", "tap", x3)]], aimet=True)
    write_bundle(tmp_path / "c", {}, [[Tensor("y", "output", x3), Tensor("y", "tap", x3)]])  # fine without AIMET


def test_valid_boxes_round_trip(bundle_dir, tmp_path):
    path, steps = bundle_dir
    rec = read_bundle(path).manifest["tensors"]["1/output/past_key_0_out"]
    assert rec["valid"] == [[[0, 2], [0, 1], [0, 8], [1, 4]]]
    assert read_bundle(path).manifest["tensors"]["1/output/logits"]["valid"] is None
    m = valid_mask(rec["shape"], rec["valid"])
    assert m.shape == (2, 1, 8, 4) and m[..., 0].sum() == 0 and m[..., 1:].all()
    assert valid_mask((2, 3), None).all()
    boxes = [[[0, 1], [0, 3]], [[1, 2], [np.int64(2), 3]]]  # union of two boxes, NumPy ints accepted
    p = write_bundle(tmp_path / "v", {}, [[Tensor("x", "tap", np.zeros((2, 3)), valid=boxes)]])
    got = read_bundle(p).manifest["tensors"]["0/tap/x"]["valid"]
    assert got == [[[0, 1], [0, 3]], [[1, 2], [2, 3]]]
    np.testing.assert_array_equal(valid_mask((2, 3), got), [[1, 1, 1], [0, 0, 1]])
    p = write_bundle(tmp_path / "e", {}, [[Tensor("x", "tap", np.zeros((2, 3)), valid=[])]])
    assert not valid_mask((2, 3), read_bundle(p).manifest["tensors"]["0/tap/x"]["valid"]).any()


def test_caller_step_info_is_merged(tmp_path):
    steps = [[Tensor("x", "input", np.zeros(1, np.float32))], [Tensor("x", "input", np.ones(1, np.float32))]]
    p = write_bundle(tmp_path / "b", {"steps": [{"positions": [0, 1]}, {"positions": [2], "index": 1}]}, steps)
    s = read_bundle(p).manifest["steps"]
    assert s[0] == {"index": 0, "inputs": ["x"], "outputs": [], "taps": [], "positions": [0, 1]}
    assert s[1]["positions"] == [2] and s[1]["index"] == 1
