"""Helpers shared by the benchmarks: timing, per-process memory, memory bandwidth, table output.

Benchmarks print ratios against a peer measured in the same run; they never assert times.
"""

import resource
import statistics
import threading
import time

import numpy as np

# ---------------------------------------------------------------------------------------------------- timing

def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    """Run fn() `repeats` times; (median seconds, all times)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


# ---------------------------------------------------------------------------------------------------- memory

def maxrss_bytes() -> int:
    """Peak resident set size of this process, in bytes.

    getrusage's ru_maxrss is max(this address space's high-water mark, the RSS the process had when it was
    exec'ed), and the second term is the forking parent's peak, which no reset clears. So where /proc is
    there, read the address space's own mark (VmHWM), which `reset_peak_rss` resets; else ru_maxrss.
    """
    hwm = _proc_status("VmHWM:")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Current resident set size (VmRSS), or 0 where /proc is unavailable."""
    return _proc_status("VmRSS:") or 0


def reset_peak_rss() -> bool:
    """Reset the peak RSS high-water mark (Linux: write 5 to /proc/self/clear_refs), so ru_maxrss measures a
    phase on its own. Returns False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------------- bandwidth

def _in_threads(fn, args: list) -> None:
    """fn(arg) for each arg, each in its own thread (NumPy releases the GIL in float loops and reductions)."""
    threads = [threading.Thread(target=fn, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, threads: int = 2) -> dict:
    """Streaming bandwidth in bytes/s over a float32 array of `nbytes`, best of `repeats` per method.

    Reads: np.sum (its pairwise float loop is partly compute bound) and np.max (cheaper), each on one thread and
    split over `threads` threads, and a matrix-vector product over the array viewed as [n, 1024] (BLAS sgemv,
    on BLAS's own threads: how a one-row linear layer reads its weight). "read" is the best of them: the rate
    NumPy demonstrably streams memory in, the honest denominator for a read-bound step. Copy (np.copyto, read +
    write, counted as 2x bytes) is for information only: it includes write traffic, which a read-bound step
    does not have.
    """
    a = np.ones(nbytes // 4, np.float32)  # touched, so every page is resident
    b = np.empty_like(a)
    parts, bparts = np.array_split(a, threads), np.array_split(b, threads)
    matrix, vector = a.reshape(-1, 1024), np.ones(1024, np.float32)
    methods = {
        "sum_1t": (lambda: np.sum(a), 1),
        f"sum_{threads}t": (lambda: _in_threads(np.sum, parts), 1),
        "max_1t": (lambda: np.max(a), 1),
        f"max_{threads}t": (lambda: _in_threads(np.max, parts), 1),
        "matvec_blas": (lambda: matrix @ vector, 1),
        "copy_1t": (lambda: np.copyto(b, a), 2),
        f"copy_{threads}t": (lambda: _in_threads(lambda i: np.copyto(bparts[i], parts[i]), list(range(threads))), 2),
    }
    rates = {}
    for name, (fn, passes) in methods.items():
        fn()
        t = min(median_time(fn, 1)[0] for _ in range(repeats))
        rates[name] = passes * a.nbytes / t
    rates["read_method"] = max((k for k in rates if not k.startswith("copy")), key=rates.get)
    rates["read"] = rates[rates["read_method"]]
    return rates


# ---------------------------------------------------------------------------------------------------- machine load

def cpu_pressure_total() -> float | None:
    """Seconds some task has waited for a CPU since boot (Linux PSI), or None where unavailable."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


def wait_idle(max_wait: float, threshold: float = 0.1, window: float = 3.0) -> float | None:
    """Wait (up to max_wait seconds) until tasks waited for a CPU less than `threshold` of a `window`-second
    window: other load on a shared machine makes every time noisy. Returns that last fraction (None: no PSI)."""
    deadline = time.monotonic() + max_wait
    while True:
        p0 = cpu_pressure_total()
        if p0 is None:
            return None
        time.sleep(window)
        frac = (cpu_pressure_total() - p0) / window
        if frac < threshold or time.monotonic() >= deadline:
            return frac


# ---------------------------------------------------------------------------------------------------- output

def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def fmt_s(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.3f} s"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_table(title: str, columns: list[str], rows: list[list[str]], plain: bool = False) -> None:
    """A rich table, or aligned plain text when `plain` or rich is missing."""
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            plain = True
    if not plain:
        table = Table(title=title)
        for i, c in enumerate(columns):
            table.add_column(c, justify="left" if i == 0 else "right")
        for r in rows:
            style = "green" if "PASS" in r[-1] else "red" if "MISS" in r[-1] else None
            table.add_row(*r, style=style)
        Console().print(table)
        return
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows)]
    print(title)
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))
