"""Running fuzz cases in worker processes under a memory and a time limit, and classifying each outcome.

A worker is forked from the runner (so the imports and the base files are shared), lowers its address-space
limit (RLIMIT_AS) to what it uses plus `memory_mib`, and then runs case after case, each in a fresh directory:
materialise the case (the base files with the case's edits applied), call the format's target on it, classify.
The runner gives each case `time_limit` seconds of CPU (TIME_LIMIT, 5 s: short, so that a reader quadratic in
its input is found as a hang rather than absorbed by a generous limit); a case that overruns it, or that waits
WAIT_FACTOR times as long in wall time (blocked: a FIFO, a lock), is killed (outcome hang) and its worker replaced,
as is one that dies (a signal: crash; SIGKILL from the kernel's OOM killer: memory). CPU time, not wall time, so
that a loaded machine (other processes taking the cores) does not turn a slow case into a hang.

Outcomes:
    ok      the target read the case without error (a mutation that left the file meaningful)
    clean   a refimpl error with a one-line message of at most MAX_MESSAGE characters
    crash   anything else escaped (its type and the innermost refimpl frame are the signature), a refimpl error
            whose message is not one short line, a read outside the case's directory, or the worker died
    hang    the case ran past the time limit
    memory  MemoryError (an allocation beyond the limit: a size the file declares, trusted)
"""

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

OUTCOMES = ("ok", "clean", "crash", "hang", "memory")
TIME_LIMIT = 5.0    # seconds of CPU per case
WAIT_FACTOR = 10    # ... and at most this many times as long in wall time
_TICK = os.sysconf("SC_CLK_TCK")
MAX_MESSAGE = 1000
_REFIMPL = str(Path(__import__("refimpl").__file__).resolve().parent)


@dataclasses.dataclass
class Outcome:
    format: str
    seed: int | None          # None for a case given by its edits (a regression case)
    outcome: str
    signature: str = ""        # crash: "<exception type> in <function> (<file>)"
    message: str = ""
    ops: list | None = None    # the edits that make the case (to reproduce it, or commit it as a regression)
    seconds: float = 0.0


def _signature(e: BaseException) -> str:
    """The exception type and the innermost frame inside refimpl/ (else the innermost frame), or the exception's own
    `signature` (a failure the target describes, e.g. a CLI run's exit status and message)."""
    if getattr(e, "signature", None):
        return e.signature
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if f.filename.startswith(_REFIMPL)]
    f = (ours or frames or [None])[-1]
    where = f"{f.name} ({Path(f.filename).relative_to(Path(_REFIMPL).parent) if ours else Path(f.filename).name}:" \
            f"{f.lineno})" if f else "?"
    return f"{type(e).__name__} in {where}"


def _audit(scratch: str, state: dict):
    """An audit hook recording every open of `scratch`/outside*: a file beside the case directory that no reader
    of a self-contained format (a bundle, a dump) may touch (symlinks and paths in the case name it). Single files
    and checkpoint directories may be symlinks to elsewhere (the Hugging Face cache links every file to a blob)."""
    outside = os.path.join(scratch, "outside")

    def hook(event, args):
        if event != "open" or state.get("case") is None:
            return
        path = args[0]
        if isinstance(path, int) or path is None:
            return
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return
        if real.startswith(outside) and state.get("contained"):
            state["escapes"].append(real)
    return hook


def _classify(fmt, seed, ops, run, case_dir, state) -> Outcome:
    from refimpl.errors import RefimplError
    start = time.perf_counter()
    state["case"], state["escapes"] = os.path.realpath(case_dir), []
    try:
        run()
        result = Outcome(fmt, seed, "ok")
    except RefimplError as e:
        msg = str(e)
        if "\n" in msg or len(msg) > MAX_MESSAGE:
            result = Outcome(fmt, seed, "crash", f"{type(e).__name__} message of {len(msg)} characters"
                             f"{', several lines' if chr(10) in msg else ''} in {_signature(e).split(' in ', 1)[1]}",
                             msg[:300])
        else:
            result = Outcome(fmt, seed, "clean", "", msg)
    except MemoryError as e:
        result = Outcome(fmt, seed, "memory", _signature(e), str(e)[:300])
    except RecursionError as e:
        result = Outcome(fmt, seed, "crash", _signature(e), "maximum recursion depth exceeded")
    except Exception as e:   # noqa: BLE001 - every other escape is what the fuzzer looks for
        result = Outcome(fmt, seed, "crash", _signature(e), f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        state["case"] = None
    if state["escapes"] and result.outcome != "crash":
        result = Outcome(fmt, seed, "crash", "read outside the case directory",
                         f"opened {sorted(set(state['escapes']))[:3]}")
    result.ops, result.seconds = ops, time.perf_counter() - start
    return result


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(conn, formats, scratch: str, memory_mib: int):
    """The worker loop: (format name, seed or None, ops or None) in, Outcome out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    limit = _vm_size() + memory_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    state = {"case": None}
    sys.addaudithook(_audit(scratch, state))
    sys.setrecursionlimit(3000)
    n = 0
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        name, seed, ops = job
        fmt = formats[name]
        case_dir = Path(scratch) / f"case-{os.getpid()}-{n}"
        n += 1
        try:
            fmt.materialise(case_dir, ops)
        except Exception as e:   # noqa: BLE001 - the fuzzer's own failure: reported, never taken for refimpl's
            result = Outcome(name, seed, "crash", f"harness: {_signature(e)}", str(e)[:300], ops)
        else:
            state["contained"] = fmt.contained
            result = _classify(name, seed, ops, lambda: fmt.target(case_dir, ops[0][1]), case_dir, state)
        finally:
            shutil.rmtree(case_dir, ignore_errors=True)
        conn.send(result)


class Pool:
    """Workers running cases; `run(jobs)` yields an Outcome per job (in completion order)."""

    def __init__(self, formats: dict, workers: int = 2, time_limit: float = TIME_LIMIT, memory_mib: int = 1536):
        self.formats, self.time_limit, self.memory_mib = formats, time_limit, memory_mib
        self.scratch = tempfile.mkdtemp(prefix="refimpl-fuzz-")
        self._ctx = multiprocessing.get_context("fork")
        for f in formats.values():
            f.prepare(Path(self.scratch))      # base files, built once and shared with the workers
        self._workers = [self._start() for _ in range(workers)]

    def _start(self):
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_worker, args=(child, self.formats, self.scratch, self.memory_mib), daemon=True)
        p.start()
        child.close()
        return {"process": p, "conn": parent, "job": None, "deadline": None, "start": None}

    def _replace(self, w):
        w["process"].kill()
        w["process"].join()
        w["conn"].close()
        w.update(self._start())

    def run(self, jobs):
        jobs = list(jobs)[::-1]
        while jobs or any(w["job"] for w in self._workers):
            for w in self._workers:
                if w["job"] is None and jobs:
                    name, seed, ops = jobs.pop()
                    if ops is None:   # chosen here, so a case that kills its worker is still known by its ops
                        ops = self.formats[name].generate(seed)
                    w["job"], w["start"] = (name, seed, ops), time.monotonic()
                    w["deadline"], w["cpu"] = w["start"] + self.time_limit, _cpu_seconds(w["process"].pid)
                    w["conn"].send(w["job"])
            busy = [w for w in self._workers if w["job"]]
            timeout = max(0.0, min(w["deadline"] for w in busy) - time.monotonic())
            ready = multiprocessing.connection.wait([w["conn"] for w in busy], timeout)
            for w in busy:
                name, seed, ops = w["job"]
                if w["conn"] in ready:
                    try:
                        result = w["conn"].recv()
                    except (EOFError, ConnectionError):
                        w["process"].join()
                        code = w["process"].exitcode
                        kind = "memory" if code == -signal.SIGKILL else "crash"
                        sig = signal.Signals(-code).name if code and code < 0 else f"exit {code}"
                        result = Outcome(name, seed, kind, f"worker died ({sig})", "", ops,
                                         time.monotonic() - w["start"])
                        self._replace(w)
                elif time.monotonic() >= w["deadline"]:
                    used = _cpu_seconds(w["process"].pid) - w["cpu"]
                    waited = time.monotonic() - w["start"]
                    if used < self.time_limit and waited < WAIT_FACTOR * self.time_limit:
                        # starved of CPU by other processes: the case gets the CPU time it has not had yet
                        w["deadline"] = time.monotonic() + min(self.time_limit - used,
                                                               WAIT_FACTOR * self.time_limit - waited)
                        continue
                    why = f"over {self.time_limit:g} s of CPU" if used >= self.time_limit else \
                        f"blocked: {used:.1f} s of CPU in {waited:.0f} s"
                    result = Outcome(name, seed, "hang", why, "", ops, waited)
                    self._replace(w)
                else:
                    continue
                w["job"] = None
                yield result

    def close(self):
        for w in self._workers:
            try:
                w["conn"].send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in self._workers:
            w["process"].join(5)
            if w["process"].is_alive():
                w["process"].kill()
                w["process"].join()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _cpu_seconds(pid: int) -> float:
    """The user + system CPU time a process has used (Linux /proc; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK    # fields 14 and 15 (utime, stime), counted from 1


def table(results: list[Outcome], formats) -> str:
    """Cases and outcomes per format, then every distinct crash / hang / memory signature with one case of it."""
    lines = [f"{'format':<12} {'cases':>7} " + " ".join(f"{o:>7}" for o in OUTCOMES) + f" {'s/case':>7}"]
    for name in formats:
        rs = [r for r in results if r.format == name]
        if not rs:
            continue
        counts = [sum(r.outcome == o for r in rs) for o in OUTCOMES]
        mean = sum(r.seconds for r in rs) / len(rs)
        lines.append(f"{name:<12} {len(rs):>7} " + " ".join(f"{c:>7}" for c in counts) + f" {mean:>7.3f}")
    bad = {}
    for r in results:
        if r.outcome in ("crash", "hang", "memory"):
            bad.setdefault((r.format, r.outcome, r.signature), []).append(r)
    for (fmt, outcome, sig), rs in sorted(bad.items()):
        lines.append(f"  {fmt} {outcome} x{len(rs)}: {sig} -- seed {rs[0].seed}: {rs[0].message[:160]}")
    return "\n".join(lines)
