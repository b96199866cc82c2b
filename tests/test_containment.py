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
