"""The documentation runs: every fenced block of README.md and docs/*.md whose info string is `sh`, `bash`, `console`
or `python` is executed (issue 31), one test per block, named `file:line`.

- The blocks of one file run in order in one temporary directory of their own, so a page's steps build on each
  other (the README's tour: golden, device, diff, replay, explain). A test runs the file's earlier blocks first when
  they have not run in this process (any selection or xdist split gives the same results); `xdist_group` keeps a
  file's blocks on one worker.
- `sh` / `bash` blocks run with `bash -euo pipefail`; `console` blocks are their `$ ` lines (a line ending in `\\`
  continues), the other lines being output; both with the venv's bin (`refimpl`, `python`) first on PATH and this
  checkout first on PYTHONPATH, stdout and stderr merged as a terminal shows them, 120 columns wide.
  `python` blocks run in this process, one namespace per file, the working directory set to the file's directory.
- The fence may say `skip="why"` (the test is skipped with that reason: a device, a large model, a network) and
  `exit=N` (the block's expected exit status, e.g. `exit=1` for a diff that finds a mismatch; default 0).
- A ```` ```text check ```` block right after a runnable block is its expected output: compared line by line with
  trailing spaces ignored, a line `...` standing for any number of lines. A plain ```` ```text ```` block is shown
  to the reader and not checked.

Runnable blocks use the tiny presets only.
"""

import contextlib
import dataclasses
import io
import os
import pathlib
import re
import subprocess
import sys
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"sh", "bash", "console", "python"}
ATTRIBUTES = {"skip", "exit"}        # key=value on a runnable fence
TEXT_FLAGS = {"check"}               # bare words on a text fence
BLOCK_TIMEOUT = 300                  # seconds per shell block
WIDTH = "120"                        # COLUMNS for the blocks' tables

# CommonMark: a fence is indented by at most 3 spaces (4 make an indented code block showing a fence)
_OPEN = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
_ATTR = re.compile(r'(\w+)=(?:"([^"]*)"|(\S+))')


@dataclasses.dataclass
class Block:
    path: pathlib.Path
    line: int                        # 1-based line of the opening fence
    lang: str
    attrs: dict
    flags: set
    code: str
    expected: str | None = None      # the text of a following ```text check block

    @property
    def id(self) -> str:
        name = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f"{name}:{self.line}"


def parse_info(info: str) -> tuple[str, dict, set]:
    """'sh skip="needs a device" exit=1' -> ('sh', {'skip': 'needs a device', 'exit': '1'}, set())."""
    lang, _, rest = info.partition(" ")
    attrs = {m.group(1): m.group(2) if m.group(2) is not None else m.group(3) for m in _ATTR.finditer(rest)}
    flags = set(_ATTR.sub(" ", rest).split())
    return lang.strip(), attrs, flags


def fenced_blocks(path: pathlib.Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a Markdown file, in order; the indentation of its fence is removed from its lines."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body, j = [], i + 1
        while j < len(lines) and not close.match(lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        lang, attrs, flags = parse_info(m.group("info"))
        blocks.append(Block(path, i + 1, lang, attrs, flags, "\n".join(body) + "\n"))
        i = j + 1
    for before, after in zip(blocks, blocks[1:]):
        if before.lang in RUNNABLE and after.lang == "text" and "check" in after.flags:
            before.expected = after.code
    return blocks


def runnable_blocks() -> list[Block]:
    return [b for path in DOCS for b in fenced_blocks(path) if b.lang in RUNNABLE]


def console_commands(code: str) -> str:
    """The commands of a console block: its `$ ` lines and their `\\` continuations; the rest is output."""
    out, continued = [], False
    for line in code.splitlines():
        if continued or line.startswith("$ "):
            out.append(line[2:] if not continued else line)
            continued = line.rstrip().endswith("\\")
    return "\n".join(out) + "\n"


def output_matches(actual: str, expected: str) -> bool:
    """Line by line, trailing spaces and surrounding blank lines ignored; a line `...` matches any run of lines."""
    def lines(s):
        return [line.rstrip() for line in s.strip("\n").splitlines()]
    want, got = lines(expected), lines(actual)

    def match(i, j):
        if i == len(want):
            return j == len(got)
        if want[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and want[i] == got[j] and match(i + 1, j + 1)
    return match(0, 0)


class Runner:
    """One temporary directory and one Python namespace per file; runs a file's blocks in order, once each."""

    def __init__(self, factory):
        self.factory = factory
        self.dirs: dict = {}
        self.namespaces: dict = {}
        self.results: dict = {}      # block id -> None (passed) or the failure message

    def env(self) -> dict:
        env = dict(os.environ)
        env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env.update(COLUMNS=WIDTH, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        env.pop("LINES", None)
        return env

    def directory(self, path) -> pathlib.Path:
        if path not in self.dirs:
            self.dirs[path] = self.factory.mktemp(path.stem.replace(".", "_"))
        return self.dirs[path]

    def run_through(self, block: Block) -> None:
        """Run the file's earlier runnable blocks that have not run here, then this one; fail as it failed."""
        for earlier in (b for b in runnable_blocks() if b.path == block.path and b.line < block.line):
            if "skip" in earlier.attrs:
                continue
            if earlier.id not in self.results:
                self.results[earlier.id] = self.execute(earlier)
            if self.results[earlier.id] is not None:
                pytest.fail(f"an earlier block of this file failed: {earlier.id}", pytrace=False)
        if block.id not in self.results:
            self.results[block.id] = self.execute(block)
        if self.results[block.id] is not None:
            pytest.fail(self.results[block.id], pytrace=False)

    def execute(self, block: Block) -> str | None:
        cwd = self.directory(block.path)
        want = int(block.attrs.get("exit", 0))
        if block.lang == "python":
            status, output = self.exec_python(block, cwd)
        else:
            code = console_commands(block.code) if block.lang == "console" else block.code
            try:
                done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=self.env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      timeout=BLOCK_TIMEOUT)
            except subprocess.TimeoutExpired:
                return f"{block.id}: did not finish in {BLOCK_TIMEOUT} s"
            status, output = done.returncode, done.stdout
        if status != want:
            return f"{block.id}: exit status {status}, expected {want}; output:\n{output}"
        if block.expected is not None and not output_matches(output, block.expected):
            return f"{block.id}: output differs from the ```text check block after it; output:\n{output}"
        return None

    def exec_python(self, block: Block, cwd: pathlib.Path) -> tuple[int, str]:
        namespace = self.namespaces.setdefault(block.path, {"__name__": f"doc_{block.path.stem}"})
        out = io.StringIO()
        before = os.getcwd()
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(block.code, block.id, "exec"), namespace)
            return 0, out.getvalue()
        except Exception:
            return 1, out.getvalue() + traceback.format_exc()
        finally:
            os.chdir(before)


@pytest.fixture(scope="session")
def doc_runner(tmp_path_factory):
    return Runner(tmp_path_factory)


def _param(block: Block):
    marks = [pytest.mark.xdist_group(f"docs-{block.path.name}")]
    if "skip" in block.attrs:
        marks.append(pytest.mark.skip(reason=f"{block.id}: {block.attrs['skip']}"))
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in runnable_blocks()])
def test_doc_block(block, doc_runner):
    unknown = set(block.attrs) - ATTRIBUTES
    assert not unknown, f"{block.id}: unknown fence attribute {sorted(unknown)} (known: {sorted(ATTRIBUTES)})"
    doc_runner.run_through(block)


def test_fences_are_known():
    """A typo in a fence (`skp=`, `text chek`) would silently run or silently not check: every runnable fence has
    known attributes only, a skip says why, and a text fence carries known flags only."""
    problems = []
    for path in DOCS:
        for b in fenced_blocks(path):
            if b.lang in RUNNABLE and (set(b.attrs) - ATTRIBUTES or b.flags):
                problems.append(f"{b.id}: {b.lang} {b.attrs} {sorted(b.flags)}")
            if b.lang in RUNNABLE and "skip" in b.attrs and not b.attrs["skip"].strip():
                problems.append(f"{b.id}: skip without a reason")
            if b.lang == "text" and (b.flags - TEXT_FLAGS or b.attrs):
                problems.append(f"{b.id}: text {b.attrs} {sorted(b.flags)}")
    assert not problems, "\n".join(problems)


def test_the_readme_tour_is_collected_and_checked():
    """The collector finds the README's tour: runnable blocks, none skipped but the set-up commands, and its key
    outputs checked (a parser that found nothing would pass everything)."""
    readme = [b for b in runnable_blocks() if b.path.name == "README.md"]
    run = [b for b in readme if "skip" not in b.attrs]
    assert len(run) >= 5 and sum(b.expected is not None for b in run) >= 3
    assert any("refimpl diff" in b.code and b.attrs.get("exit") == "1" for b in run)


def test_the_collector_on_a_page(tmp_path, tmp_path_factory):
    """The collector itself: blocks build on each other, a wrong exit status, a stale output and an unknown
    fence fail; `...` elides lines; console prompts are stripped."""
    page = tmp_path / "page.md"
    page.write_text('intro\n\n```sh\necho one > f\n```\n\n```console\n$ cat f\none\n```\n\n```text check\none\n```\n'
                    '\n```python\nprint(open("f").read().strip() * 2)\nx = 3\n```\n\n```text check\noneone\n```\n'
                    '\n```python\nassert x == 3\n```\n\n```sh exit=1\necho a; echo b; echo c; false\n```\n'
                    '```text check\na\n...\nc\n```\n\n```sh\nexit 3\n```\n\n```sh\necho two\n```\n'
                    '```text check\nthree\n```\n\n   ```sh skip="needs a device"\n   qnn-net-run\n   ```\n'
                    '\n    ```sh\n    an indented code block, not a fence\n')
    blocks = [b for b in fenced_blocks(page) if b.lang in RUNNABLE]
    assert [b.lang for b in blocks] == ["sh", "console", "python", "python", "sh", "sh", "sh", "sh"]
    assert blocks[-1].attrs == {"skip": "needs a device"} and blocks[-1].code == "qnn-net-run\n"
    assert console_commands(blocks[1].code) == "cat f\n"
    runner = Runner(tmp_path_factory)
    results = [runner.execute(b) for b in blocks[:-1]]
    assert results[:5] == [None] * 5
    assert "exit status 3, expected 0" in results[5]
    assert "output differs" in results[6]
    assert output_matches("a\nb\nc\n", "a\n...\nc") and output_matches("a\nc", "a\n...\nc")
    assert not output_matches("a\nb\n", "a\n...\nc") and not output_matches("a\nb\nc\nd", "a\n...\nc")
    assert parse_info('sh skip="a b" exit=1') == ("sh", {"skip": "a b", "exit": "1"}, set())
    assert parse_info("text check") == ("text", {}, {"check"})
