"""Reading a bundle or a device dump never touches anything outside its directory: '..', absolute paths, symlinks
leaving it, /dev/zero as a file, and sizes declared far beyond the file are each a one-line FormatError, and no
file outside is opened (an audit hook watches every open)."""

import contextlib
import json
import os
import sys

import numpy as np
import pytest

from refimpl.bundle import Tensor, read_bundle, write_bundle
from refimpl.errors import FormatError

_OPENED: list | None = None


def _audit(event, args):
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)   # records only inside opened_files(): a no-op for the rest of the session


@contextlib.contextmanager
def opened_files():
    """The real paths of every file opened inside the block."""
    global _OPENED
    _OPENED = seen = []
    try:
        yield seen
    finally:
        _OPENED = None


def one_line_format_error(call, outside) -> str:
    """Run call(): it must raise a one-line FormatError and open nothing under `outside`."""
    with opened_files() as seen, pytest.raises(FormatError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message and len(message) < 1000, message
    assert not [p for p in seen if p.startswith(str(outside))], seen
    return message


@pytest.fixture
def case(tmp_path):
    """(bundle directory, a directory beside it whose files no reader may open)."""
    rng = np.random.default_rng(0)
    steps = [[Tensor("input_ids", "input", np.array([[1, 2, 3, 4]], np.int32), "b,t"),
              Tensor("logits", "output", rng.standard_normal((1, 4, 8)).astype(np.float32), "b,t,v"),
              Tensor("model.norm", "tap", rng.standard_normal((1, 4, 8)).astype(np.float32), "b,t,d")]
             for _ in range(2)]
    bundle = write_bundle(tmp_path / "bundle", {"model": {"source": "test"}}, steps, exports=("npz",))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.raw").write_bytes(np.zeros(32, np.float32).tobytes())
    return bundle, outside


def _edit_manifest(bundle, edit):
    mf = bundle / "manifest.json"
    m = json.loads(mf.read_text())
    edit(m)
    mf.write_text(json.dumps(m))


def _read_all(bundle, verify):
    b = read_bundle(bundle, verify=verify)
    for rec in b.records():
        np.asarray(b.tensor(rec["step"], rec["role"], rec["name"])).sum()
    b.input_list()
    if verify:
        b.verify()


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("edit,match", [
    (lambda m, o: m["derived"].update({"../outside/secret.raw": {"size": 128, "sha256": "0" * 64}}), "leaves"),
    (lambda m, o: m["derived"].update({str(o / "secret.raw"): {"size": 128, "sha256": "0" * 64}}), "leaves"),
    (lambda m, o: m["derived"].update({"/dev/zero": {"size": 128, "sha256": "0" * 64}}), "leaves"),
    (lambda m, o: m["tensors"]["0/tap/model.norm"].update(file="../outside/secret.raw"), "expected steps/0"),
    (lambda m, o: m["tensors"]["0/tap/model.norm"].update(step="../.."), "step"),
    (lambda m, o: m["tensors"]["0/tap/model.norm"].update(shape=[2**40, 4, 8]), "bytes, expected"),
    (lambda m, o: m["tensors"]["0/tap/model.norm"].update(shape=[2**31, 2**31, 2**31]), "bytes, expected"),
])
def test_manifest_paths_and_sizes(case, edit, match, verify):
    bundle, outside = case
    _edit_manifest(bundle, lambda m: edit(m, outside))
    assert match in one_line_format_error(lambda: _read_all(bundle, verify), outside)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("target", ["outside", "/dev/zero", "loop"])
def test_raw_file_symlinked_out(case, target, verify):
    """A tensor's raw file that is a symlink to a file outside, to /dev/zero, or to itself."""
    bundle, outside = case
    raw = bundle / "steps/1/taps/model.norm.raw"
    raw.unlink()
    raw.symlink_to({"outside": outside / "secret.raw", "/dev/zero": "/dev/zero", "loop": raw}[target])
    one_line_format_error(lambda: _read_all(bundle, verify), outside)


def test_derived_file_symlinked_to_dev_zero(case):
    """A derived file (here the .npz export) replaced by a link to /dev/zero: verify never reads it."""
    bundle, outside = case
    (bundle / "bundle.npz").unlink()
    (bundle / "bundle.npz").symlink_to("/dev/zero")
    assert "symlink" in one_line_format_error(lambda: read_bundle(bundle).verify(), outside)


def test_steps_directory_symlinked_out(case):
    """A whole step directory that is a link outside the bundle (the files in it have the right names)."""
    bundle, outside = case
    import shutil
    shutil.copytree(bundle / "steps/1", outside / "1")
    shutil.rmtree(bundle / "steps/1")
    (bundle / "steps/1").symlink_to(outside / "1")
    for verify in (True, False):
        one_line_format_error(lambda: _read_all(bundle, verify), outside)


@pytest.mark.parametrize("line", ["input_ids:=../outside/secret.raw", "input_ids:=/etc/passwd",
                                  "input_ids:=steps/0/inputs/../../../outside/secret.raw"])
def test_input_list_paths(case, line):
    bundle, outside = case
    lines = (bundle / "input_list.txt").read_text().splitlines()
    lines[0] = line
    (bundle / "input_list.txt").write_text("\n".join(lines) + "\n")
    one_line_format_error(lambda: read_bundle(bundle, verify=False).input_list(), outside)


def test_manifest_symlinked_out(case):
    bundle, outside = case
    (outside / "manifest.json").write_bytes((bundle / "manifest.json").read_bytes())
    (bundle / "manifest.json").unlink()
    (bundle / "manifest.json").symlink_to(outside / "manifest.json")
    one_line_format_error(lambda: read_bundle(bundle), outside)


def test_the_audit_hook_sees_reads_outside(case):
    """The watch above can fail: a plain read of the outside file is seen."""
    bundle, outside = case
    with opened_files() as seen:
        (outside / "secret.raw").read_bytes()
    assert str((outside / "secret.raw").resolve()) in seen


# ---------------------------------------------------------------------------------------------- device dumps

def _qnn_dump(bundle, root):
    """A qnn-net-run output directory of the bundle's logits and norm taps: Result_<k>/<name>.raw (float32)."""
    b = read_bundle(bundle)
    for k in range(b.steps):
        (root / f"Result_{k}").mkdir(parents=True)
        for name, role in (("logits", "output"), ("model.norm", "tap")):
            raw = np.asarray(b.tensor(k, role, name), np.float32).tobytes()
            (root / f"Result_{k}" / f"{name}.raw").write_bytes(raw)
    return b


def _problems(dump_path, b, outside, **kw):
    """read_dump's items: every load that fails is a one-line FormatError and no file outside is opened."""
    from refimpl.diff.dump import read_dump
    with opened_files() as seen:
        d = read_dump(dump_path, b, **kw)
    assert not [p for p in seen if p.startswith(str(outside))], seen
    problems = {k: i.problem for k, i in d.items.items() if i.problem}
    assert all("\n" not in p for p in problems.values())
    return d, problems


@pytest.mark.parametrize("target", ["outside", "/dev/zero", "loop", "fifo"])
def test_dump_file_symlinked_out_or_not_a_file(case, target):
    bundle, outside = case
    dump = bundle.parent / "dump"
    b = _qnn_dump(bundle, dump)
    f = dump / "Result_1" / "logits.raw"
    f.unlink()
    if target == "fifo":
        os.mkfifo(f)
    else:
        f.symlink_to({"outside": outside / "secret.raw", "/dev/zero": "/dev/zero", "loop": f}[target])
    d, problems = _problems(dump, b, outside)
    assert list(problems) == ["1/output/logits"], problems
    assert d.items["0/output/logits"].array is not None


def test_dump_directory_symlinked_out_is_not_followed(case):
    bundle, outside = case
    dump = bundle.parent / "dump"
    b = _qnn_dump(bundle, dump)
    (dump / "Result_1").rename(outside / "Result_1")
    (dump / "Result_1").symlink_to(outside / "Result_1")
    d, problems = _problems(dump, b, outside)
    assert "1/output/logits" not in d.items or "1/output/logits" in problems


def _npy_with_header(array, header: str) -> bytes:
    """An .npy file whose header dict text is `header` (the array's data kept)."""
    import io
    buf = io.BytesIO()
    np.save(buf, array)
    data = buf.getvalue()
    n = int.from_bytes(data[8:10], "little")
    h = header.encode("latin1")
    h += b" " * (-(10 + len(h) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + data[10 + n:]


BAD_HEADERS = {
    "2^40 elements": "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }",
    "2^62 x 2^62": "{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 4611686018427387904), }",
    "negative size": "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }",
    "object dtype": "{'descr': '|O', 'fortran_order': False, 'shape': (32,), }",
    "cut short": "{'descr': '<f4', 'fortran_order': False, 'shape': (3, ",
    "not a dict": "(((((((((((((((((((((((((((((((((((((((",
}


@pytest.mark.parametrize("header", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_npy_headers_checked_before_allocating(case, header):
    """A damaged or oversized .npy header, in a dump directory and as an .npz member: a one-line FormatError
    (before anything is allocated: 2^40 float32 elements would be 4 TiB)."""
    import zipfile
    bundle, outside = case
    b = read_bundle(bundle)
    logits = np.asarray(b.tensor(0, "output", "logits"))
    (bundle.parent / "npy" / "0").mkdir(parents=True)
    (bundle.parent / "npy" / "0" / "logits.npy").write_bytes(_npy_with_header(logits, header))
    with zipfile.ZipFile(bundle.parent / "dump.npz", "w") as z:
        z.writestr("0/logits.npy", _npy_with_header(logits, header))
        norm_header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 4, 8), }"
        z.writestr("0/model.norm.npy", _npy_with_header(np.asarray(b.tensor(0, "tap", "model.norm")), norm_header))
    for dump in (bundle.parent / "npy", bundle.parent / "dump.npz"):
        d, problems = _problems(dump, b, outside)
        assert list(problems) == ["0/output/logits"], problems


def test_dump_policy_and_mapping_json_bounded(case, tmp_path):
    """--policy / --mapping / --rejudge files: deep nesting, a FIFO, wrong types are one-line InputErrors."""
    from refimpl.diff import load_metrics, load_policy
    from refimpl.diff.dump import read_mapping
    from refimpl.errors import InputError
    (tmp_path / "deep.json").write_text("[" * 50_000 + "]" * 50_000)
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "list.json").write_text('{"tensors": [{"match": "x", "max_nmse": [1]}], "layouts": {"x": [2]}}')
    for read in (load_policy, read_mapping, load_metrics):
        for name in ("deep.json", "fifo.json", "list.json"):
            with pytest.raises(InputError) as e:
                read(tmp_path / name)
            assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- checkpoints

def _sharded(d, tmp_path):
    """A two-shard HF checkpoint laid out as the Hugging Face cache does: snapshot files are links to blobs."""
    from refimpl.formats.safetensors import write_safetensors
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    d.mkdir()
    model = __import__("refimpl").load("tiny-qwen3")
    names = sorted(model.weights.stored)
    weight_map = {}
    for i in range(2):
        f = f"model-{i + 1:05d}-of-00002.safetensors"
        write_safetensors(blobs / f"blob{i}", {n: np.asarray(model.weights.stored[n]) for n in names[i::2]})
        (d / f).symlink_to(blobs / f"blob{i}")
        weight_map.update({n: f for n in names[i::2]})
    return weight_map


@pytest.mark.parametrize("shard", ["../outside/x.safetensors", "/etc/passwd", "sub", ""])
def test_shard_index_names_only_files_inside(tmp_path, shard):
    """A shard index naming a path outside the checkpoint, an absolute path, a directory or nothing: a one-line
    FormatError; shards that are links elsewhere (the Hugging Face cache's blobs) are read."""
    from refimpl.formats.safetensors import read_checkpoint
    d = tmp_path / "snapshot"
    weight_map = _sharded(d, tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    arrays, origins = read_checkpoint(d)
    assert set(arrays) == set(weight_map)
    (d / "sub").mkdir()
    weight_map[next(iter(weight_map))] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    one_line_format_error(lambda: read_checkpoint(d), tmp_path / "outside")
