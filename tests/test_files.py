"""refimpl.files: the JSON nesting pre-scan (one pass, the same depths as a character-by-character reading) and
the recovery of a directory replacement a dead writer left half done."""

import logging
import os
import random
import subprocess
import sys

from refimpl import files


def _depth_by_hand(data: bytes) -> int:
    """The deepest [ / { nesting outside strings, read one character at a time (an escape skips the next one)."""
    depth = deepest = 0
    inside = escaped = False
    for c in data:
        if inside:
            if escaped:
                escaped = False
            elif c == ord("\\"):
                escaped = True
            elif c == ord('"'):
                inside = False
        elif c == ord('"'):
            inside = True
        elif c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in b"]}":
            depth -= 1
    return deepest


def test_json_depth_agrees_with_a_reading_by_hand():
    """20,000 random strings of the characters that matter (quotes, backslashes, brackets), unterminated strings
    and trailing backslashes included."""
    rnd = random.Random(0)
    for _ in range(20_000):
        data = bytes(rnd.choice(b'"\\[]{}a') for _ in range(rnd.randint(0, 24)))
        assert files.json_depth(data) == _depth_by_hand(data), data
    assert files.json_depth(b'{"a": [1, "[[{"], "b\\"": {"c": []}}') == 3


def test_json_depth_of_an_unterminated_string_of_escaped_quotes():
    """The input the old pre-scan was quadratic on (it retried the string pattern from each quote in it): the
    brackets after the opening quote are inside the string, so they do not count."""
    data = b'{"a": [' + b'"x' + b'\\"[' * 50_000
    assert files.json_depth(data) == 2


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_recover_renames_the_new_tree_of_an_interrupted_replacement(tmp_path, caplog):
    """A writer without RENAME_EXCHANGE killed between its two renames: no target, its old and new trees beside
    it. recover (read_bundle and the next writer call it) renames the new one in, logs one line, and the next
    sweep removes the old one; a live writer's trees are left alone."""
    pid = _dead_pid()
    old, new = tmp_path / f".case.old-{pid}-0123abcd", tmp_path / f".case.tmp-{pid}-0123abcd"
    for d, text in ((old, "old"), (new, "new")):
        d.mkdir()
        (d / "f").write_text(text)
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])   # a live writer
    try:
        live, live_new = tmp_path / f".other.old-{writer.pid}-0123abcd", tmp_path / f".other.tmp-{writer.pid}-0123abcd"
        live.mkdir()
        live_new.mkdir()
        with caplog.at_level(logging.WARNING, "refimpl.files"):
            assert files.recover(tmp_path / "case", "bundle")
        assert (tmp_path / "case" / "f").read_text() == "new" and not new.exists() and old.exists()
        assert len(caplog.records) == 1 and "restored the new one" in caplog.records[0].getMessage()
        assert not files.recover(tmp_path / "other") and live.exists() and live_new.exists()
        files.sweep(tmp_path / "case")
        assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, live_new.name, "case"]
    finally:
        writer.kill()
        writer.wait()


def test_recover_never_restores_an_old_tree_without_its_new_one(tmp_path):
    """An `.old-*` whose `.tmp-*` partner is gone belongs to a finished replacement (the target since removed by
    someone else): it may be partial, so it is not put back, and nothing deletes it while the target is absent."""
    pid = _dead_pid()
    old = tmp_path / f".case.old-{pid}-0123abcd"
    old.mkdir()
    (old / "f").write_text("old")
    assert not files.recover(tmp_path / "case")
    files.sweep(tmp_path / "case")
    assert not (tmp_path / "case").exists() and (old / "f").read_text() == "old"


def test_a_crash_while_the_old_tree_is_removed_leaves_nothing_to_restore(tmp_path, monkeypatch):
    """Without RENAME_EXCHANGE the replaced tree is renamed to a temporary before its removal: a writer killed
    during that removal leaves a temporary the next sweep removes, never a partial tree that recover restores."""
    target = tmp_path / "case"
    with files.atomic_directory(target) as tmp:
        (tmp / "f").write_text("old")
    monkeypatch.setattr(files, "exchange", lambda a, b: False)
    removed = []
    monkeypatch.setattr(files, "_remove_tree", lambda p: removed.append(p))   # killed before it removes anything
    with files.atomic_directory(target, overwrite=True) as tmp:
        (tmp / "f").write_text("new")
    assert removed and all(".tmp-" in p.name for p in removed)
    monkeypatch.undo()
    for p in removed:                              # the writer's pid is ours: make its leftovers a dead writer's
        p.rename(p.with_name(p.name.split(".tmp-")[0] + f".tmp-{_dead_pid()}-0123abcd"))
    files.discard(target)                          # the target removed by someone else
    assert not files.recover(target)
    files.sweep(target)
    assert list(tmp_path.iterdir()) == []


def test_names_no_pid_can_have_and_our_own_pid_reused(tmp_path):
    """A leftover named with a pid no process can have (too large, 0) is a dead writer's, not a crash; one named with
    this process's pid but a token it did not make is a dead writer's whose pid was reused."""
    for pid in ("99999999999999999999", "0", str(os.getpid())):
        (tmp_path / f".x.tmp-{pid}-deadbeef").mkdir()
    with files.atomic_directory(tmp_path / "x") as tmp:
        (tmp / "f").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_exchange_swaps_two_directories(tmp_path):
    """renameat2(RENAME_EXCHANGE) through ctypes (this test machine: Linux, ext4 / tmpfs): both names stay, their
    contents trade places."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    assert files.exchange(a, b)
    assert (b / "x").read_text() == "a" and not (a / "x").exists()
