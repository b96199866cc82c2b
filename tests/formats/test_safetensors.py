"""safetensors writing: atomic through refimpl.files (a temporary file beside the target, with a name of its own,
renamed into place when whole), read back as written; a failure names the file and leaves nothing behind."""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from refimpl.errors import InputError
from refimpl.formats.safetensors import read_safetensors, write_safetensors


def test_written_file_reads_back_and_leaves_no_temporary(tmp_path):
    arrays = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(2, ml_dtypes.bfloat16),
              "c": np.arange(3, dtype=np.int64)}
    write_safetensors(tmp_path / "m.safetensors", arrays, {"k": 1})
    back = read_safetensors(tmp_path / "m.safetensors")
    assert set(back) == set(arrays)
    for name, a in arrays.items():
        assert back[name].dtype == a.dtype and np.array_equal(back[name], a)
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_unwritable_target_is_a_one_line_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # a short path: the message quotes at most 80 characters of it
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match=r"file/m\.safetensors'?: cannot write the safetensors file \(File exists\)"):
        write_safetensors("file/m.safetensors", {"x": np.zeros(2, np.float32)})
    with pytest.raises(InputError, match="must be a file path, not a directory"):
        write_safetensors(tmp_path, {"x": np.zeros(2, np.float32)})
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_temporaries_a_killed_writer_left_are_removed(tmp_path):
    """A writer killed mid-file leaves its `.name.tmp-<pid>-<hex>`; the next write of that file removes it (a live
    writer's, and other files', stay)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])   # another, live writer
    try:
        left = [tmp_path / f".m.safetensors.tmp-{pid}-0123abcd", tmp_path / f".m.safetensors.tmp-{live.pid}-0123abcd",
                tmp_path / f".other.safetensors.tmp-{pid}-0123abcd"]
        for p in left:
            p.write_bytes(b"partial")
        write_safetensors(tmp_path / "m.safetensors", {"x": np.zeros(2, np.float32)})
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([left[1].name, left[2].name, "m.safetensors"])
    finally:
        live.kill()
        live.wait()
