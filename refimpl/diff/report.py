"""The diff's two faces: a terminal table (worst first, first divergence highlighted) and a self-contained
HTML report (render_html; the CLI writes it atomically) with plots (error vs layer, vs token position, vs decode
step; histogram of the first failing tensor's error). Plots are PNGs rendered with matplotlib (Agg) and embedded
as data URIs: one file to mail.
"""

import base64
import html
import io
import math
import os
import sys

import numpy as np
from rich.console import Console
from rich.table import Table

from .curves import layer_curve, position_curve, step_curve
from .results import FAILING, Report

_COLUMNS = ("sqnr_db", "nmse", "cosine", "max_abs", "rel_p99", "not_close_frac", "ulp_max")


def fmt(v, key="") -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if key == "not_close_frac":
            return f"{100 * v:.2f}%"
        if key in ("sqnr_db",):
            return f"{v:.1f}"
        if key == "cosine":
            return f"{v:.6f}"
        return f"{v:.3g}"
    return str(v)


def ordered(report: Report) -> list:
    """Failures first (first divergences on top, then by SQNR, lowest first), then the rest by SQNR."""
    first = set(report.first_divergence.values())

    def key(r):
        s = r.metrics["sqnr_db"] if r.metrics else -math.inf
        if math.isnan(s):  # nothing valid to score (an empty cache window) sorts last unless it failed
            s = -math.inf if r.status in FAILING else math.inf
        return (r.status not in FAILING, r.key not in first, r.step if r.key in first else 0, s)
    return sorted(report.results, key=key)


def terminal() -> Console:
    """The console tables print to: the terminal's width, else $COLUMNS, else 200 (a pipe or a file)."""
    columns = os.environ.get("COLUMNS", "")
    return Console(width=None if sys.stdout.isatty() else int(columns) if columns.isdigit() else 200)


def print_table(console: Console, title: str, columns: list, rows: list, styles: list | None = None) -> list:
    """A table whose cells are never cut. columns: (header, drop order or None for a column that always shows,
    wraps) in display order; rows: lists of cell strings. Columns that do not fit the console are left out,
    the highest drop order first; a wrapping column (notes) folds its text instead. If even the columns that always
    show do not fit, each row is printed as lines of `header: value` (names whole; the terminal wraps).
    Returns the headers left out."""
    def width(i):
        cells = [len(columns[i][0])] + [len(r[i]) for r in rows]
        return (min(max(cells), 12) if columns[i][2] else max(cells)) + 3
    kept = list(range(len(columns)))
    dropped = []
    while sum(width(i) for i in kept) + 1 > console.width:
        optional = [i for i in kept if columns[i][1] is not None]
        if not optional:
            break
        worst = max(optional, key=lambda i: columns[i][1])
        kept.remove(worst)
        dropped.append(columns[worst][0])
    if sum(width(i) for i in kept) + 1 > console.width:  # too narrow for a table: one block per row
        console.print(title)
        for j, r in enumerate(rows):
            style = styles[j] if styles else None
            console.print("  ".join(r[i] for i in kept[:2]), style=style, soft_wrap=True, highlight=False)
            console.print("    " + "  ".join(f"{columns[i][0]}: {r[i]}" for i in kept[2:] if r[i]), style=style,
                          soft_wrap=True, highlight=False)
        return dropped
    t = Table(title=title)
    for i in kept:
        header, _, wraps = columns[i]
        t.add_column(header, overflow="fold" if wraps else "ignore", no_wrap=not wraps,
                     min_width=None if wraps else width(i) - 3)
    for j, r in enumerate(rows):
        t.add_row(*(r[i] for i in kept), style=styles[j] if styles else None)
    console.print(t)
    return dropped


# (header, drop order: None = always shown, higher = left out first on a narrow terminal, wraps)
_TABLE = (("step", None, False), ("tensor", None, False), ("role", 9, False), ("status", None, False),
          ("origin", 2, False), ("SQNR dB", None, False), ("NMSE", 6, False), ("cosine", 8, False),
          ("max abs", 7, False), ("rel@p99", 10, False), ("not-close", 11, False), ("ULP max", 12, False),
          ("NaN/Inf", 3, False), ("note", 4, True))


def print_report(report: Report, console: Console | None = None, top: int = 20) -> None:
    console = console or terminal()
    first = set(report.first_divergence.values())
    rows, styles = [], []
    ordered_rows = ordered(report)
    for r in ordered_rows[:top] if top else ordered_rows:
        m = r.metrics or {}
        nonfinite = f"{m.get('n_nan', 0)}/{m.get('n_inf', 0)}" if m else ""
        rows.append([str(r.step), ("* " if r.key in first else "") + r.name, r.role, r.status, r.origin or "",
                     *(fmt(m.get(c), c) for c in _COLUMNS), nonfinite, r.problem or "; ".join(r.failures)])
        styles.append("bold red" if r.key in first else ("red" if r.status in FAILING else None))
    dropped = print_table(console, f"refimpl diff: {report.dump} vs {report.bundle}", list(_TABLE), rows, styles)
    if dropped:
        console.print(f"(left out to fit {console.width} columns: {', '.join(dropped)}; --json / --html have them all)",
                      highlight=False)
    counts = {}
    for r in report.results:
        counts[r.status] = counts.get(r.status, 0) + 1
    console.print(f"{len(report.results)} tensors compared: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                  + f"; {report.absent} taps / inputs not in the dump; dtype {report.policy['dtype']}")
    by_key = {r.key: r for r in report.results}
    for k, key in report.first_divergence.items():
        if key:
            r = by_key[key]
            where = f"layer {r.layer}, " if r.layer is not None else ""
            console.print(f"[bold red]first divergence, step {k}:[/] {r.name} ({r.role}; {where}op "
                          f"{op_name(r.name, r.op)}) {r.problem or '; '.join(r.failures)}", soft_wrap=True)
            if r.fault:
                console.print(f"  fault: {fault_line(r.fault)}", soft_wrap=True, markup=False, highlight=False)
    for note in report.notes[1:]:
        console.print(f"note: {note}", soft_wrap=True)
    if report.unknown:
        console.print(f"{len(report.unknown)} dump files match no tensor of the bundle, e.g. "
                      + "; ".join(report.unknown[:3]) + ("" if len(report.unknown) <= 3 else
                                                         " (--json / --html list them all)"), soft_wrap=True)
    for r in report.missing:
        console.print(f"missing output: step {r.step} {r.name}", soft_wrap=True)
    console.print(_verdict(report, "[bold red]{}[/]", "[bold green]{}[/]"))


def fault_line(fault: dict) -> str:
    """A first divergence's fault in one line: class, what was fitted, the residual NMSE before -> after."""
    return (f"{fault['class']}: {fault['summary']}" + ("" if fault["class"] in ("unexplained", "non-finite") else
                                                       f" (residual NMSE {fault['residual_before']:.3g} -> "
                                                       f"{fault['residual_after']:.3g})"))


def op_name(name: str, op: str | None) -> str:
    """The op a tensor names, with its kind: 'conv1d (causal_conv1d + silu)', 'past_key_3_out (graph output)'."""
    short = name.rsplit(".", 1)[-1] if name.startswith("model.layers.") else name
    return f"{short} ({op})" if op else short


def _verdict(report: Report, bad: str, good: str) -> str:
    if report.failed:
        return bad.format("MISMATCH")
    if report.missing:
        return bad.format(f"INCOMPLETE ({len(report.missing)} graph outputs missing from the dump)")
    diverged = sum(r.status == "diverged" for r in report.results)
    return good.format(f"PASS ({diverged} tensors after a tie or fork not judged)" if diverged else "PASS")


# ------------------------------------------------------------------------------------------------ HTML

def figure_png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt  # lazy: matplotlib is heavy, and only the HTML report draws
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _clip(v):
    return 200.0 if math.isinf(v) and v > 0 else (-50.0 if not math.isfinite(v) else v)


def plots(report: Report, first_error: np.ndarray | None = None) -> dict:
    """title -> PNG data URI."""
    import matplotlib  # lazy: matplotlib is heavy, and only the HTML report draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    out = {}
    steps = sorted({r.step for r in report.results})
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for k in steps:
        c = layer_curve(report, k)
        if c:
            ax.plot(list(c), [_clip(v) for v in c.values()], marker="o", label=f"step {k}")
    ax.set_xlabel("layer"), ax.set_ylabel("worst SQNR dB (200 = exact)"), ax.grid(alpha=.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(steps) <= 12:
        ax.legend(fontsize=7)
    out["Error vs layer (worst tensor of each layer, KV and GDN state included)"] = figure_png(fig)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = ["logits"] + sorted({r.name for r in report.results if r.positions and r.role == "tap"
                                 and r.name.count(".") == 2 and r.name.startswith("model.layers.")},
                                key=lambda n: int(n.split(".")[2]))[-1:]
    for n in names:
        c = position_curve(report, n)
        if c:
            ax.plot([p for p, _ in c], [_clip(v) for _, v in c], marker=".", label=n)
    ax.set_xlabel("token position"), ax.set_ylabel("SQNR dB"), ax.grid(alpha=.3), ax.legend(fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    out["Error vs token position"] = figure_png(fig)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    groups = {"logits": ["logits"]}
    for r in report.results:
        if r.role == "output" and r.name != "logits":
            kind = "KV cache" if "key" in r.name or "value" in r.name else "GDN state"
            groups.setdefault(kind, []).append(r.name)
    for label, names in groups.items():
        c = step_curve(report, set(names))
        if c:
            ax.plot(list(c), [_clip(v) for v in c.values()], marker="o", label=label)
    ax.set_xlabel("step (graph call)"), ax.set_ylabel("worst SQNR dB"), ax.grid(alpha=.3), ax.legend(fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    out["Error vs decode step (outputs)"] = figure_png(fig)
    if first_error is not None and first_error.size:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        e = first_error[np.isfinite(first_error)]
        ax.hist(e, bins=60, color="#b33")
        ax.set_yscale("log"), ax.set_xlabel("device - golden"), ax.set_ylabel("elements")
        out["Histogram of the first failing tensor's error"] = figure_png(fig)
    return out


def fault_plots(arrays: tuple | None) -> dict:
    """title -> PNG data URI: device vs reference at the first divergence with the fitted line, and for a
    per-slice gain / offset its per-slice factors with +-2 standard errors."""
    if arrays is None:
        return {}
    import matplotlib  # lazy: matplotlib is heavy, and only the HTML report draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    golden, device, valid, fault = arrays
    ok = valid & np.isfinite(golden) & np.isfinite(device)
    g, d = golden[ok].astype(np.float64), device[ok].astype(np.float64)
    pick = np.random.default_rng(0).choice(g.size, min(g.size, 20000), replace=False) if g.size else []
    out = {}
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.scatter(g[pick], d[pick], s=2, alpha=.4, color="#b33", label="elements")
    lo, hi = (float(g.min()), float(g.max())) if g.size else (0.0, 1.0)
    xs = np.array([lo, hi])
    ax.plot(xs, xs, color="#888", lw=1, label="device = reference")
    p = fault["params"]
    if fault["class"] in ("gain", "sign/swap") and "factor" in p and "axis" not in p:
        ax.plot(xs, p["factor"] * xs, color="#06c", lw=1.5, label=f"fit: device = {p['factor']:.5g} reference")
    elif fault["class"] == "offset" and "offset" in p:
        ax.plot(xs, xs + p["offset"], color="#06c", lw=1.5, label=f"fit: device = reference + {p['offset']:.4g}")
    elif fault["class"] in ("gain", "offset", "sign/swap") and "slices" in p:
        moved = np.zeros(golden.shape[p["axis"]], bool)
        moved[p["slices"]] = True
        sel = np.broadcast_to(np.expand_dims(moved, tuple(i for i in range(golden.ndim) if i != p["axis"])),
                              golden.shape)[ok]
        ax.scatter(g[sel], d[sel], s=4, color="#06c", label=f"slices {p['slices'][:6]} of axis {p['axis']}")
        for v in sorted(set(round(v, 6) for v in p.get("factors", p.get("offsets", []))))[:3]:
            ys = v * xs if "factors" in p else xs + v
            ax.plot(xs, ys, color="#06c", lw=1, label="fit: device = " + (f"{v:.5g} reference" if "factors" in p
                                                                          else f"reference + {v:.4g}"))
    elif fault["class"] == "saturation":
        ax.plot(xs, np.clip(xs, p["lo"] if p["lo"] is not None else -np.inf, p["hi"] if p["hi"] is not None
                            else np.inf), color="#06c", lw=1.5, label="fit: clip(reference, lo, hi)")
    ax.set_xlabel("reference"), ax.set_ylabel("device"), ax.grid(alpha=.3), ax.legend(fontsize=7)
    out[f"Device vs reference at the first divergence: {fault['class']}"] = figure_png(fig)
    if fault["class"] in ("gain", "offset") and "axis" in p:
        a = p["axis"]
        axes = tuple(i for i in range(golden.ndim) if i != a)
        r, dv = np.where(ok, golden, 0.0).astype(np.float64), np.where(ok, device, 0.0).astype(np.float64)
        n = np.maximum(ok.sum(axis=axes), 2)
        if fault["class"] == "gain":
            rr = np.maximum((r * r).sum(axis=axes), 1e-300)
            est = (dv * r).sum(axis=axes) / rr                                          # c_j = <d_j, r_j> / <r_j, r_j>
            fit = np.expand_dims(est, axes) * r
            se = np.sqrt(np.sum(np.where(ok, dv - fit, 0) ** 2, axis=axes) / (n - 1) / rr)
        else:
            est = (dv - r).sum(axis=axes) / n                                           # b_j = mean_j (d - r)
            res = np.where(ok, dv - r - np.expand_dims(est, axes), 0)
            se = np.sqrt(np.sum(res ** 2, axis=axes) / (n - 1) / n)
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.errorbar(np.arange(est.size), est, yerr=2 * se, fmt="o", ms=3, color="#b33", ecolor="#333")
        ax.axhline(1.0 if fault["class"] == "gain" else 0.0, color="#888", lw=1)
        ax.set_xlabel(f"slice of axis {a}"), ax.set_ylabel("fitted " + ("factor" if fault["class"] == "gain"
                                                                       else "offset") + " (+-2 s.e.)")
        ax.grid(alpha=.3)
        out[f"Per-slice {fault['class']} along axis {a} (the fit)"] = figure_png(fig)
    return out


def render_html(report: Report, first_error: np.ndarray | None = None, fault_arrays: tuple | None = None) -> str:
    """The self-contained HTML report. fault_arrays: (golden, device, valid mask, fault dict) of the earliest
    first divergence, for its scatter plot."""
    by_key = {r.key: r for r in report.results}
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>refimpl diff</title><style>",
             "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:2px 6px}tr.fail{background:#fdd}tr.first{background:#f99;"
             "font-weight:bold}img{max-width:100%}.pass{color:#070}.bad{color:#b00}</style></head><body>",
             f"<h1>refimpl diff</h1><p>device <code>{html.escape(report.dump)}</code> vs golden "
             f"<code>{html.escape(report.bundle)}</code>; device dtype {report.policy['dtype']}</p>"]
    verdict = _verdict(report, "<b class='bad'>{}</b>", "<b class='pass'>{}</b>")
    parts.append(f"<p>Verdict: {verdict}. {len(report.results)} tensors compared, {len(report.failed)} failing, "
                 f"{report.absent} not in the dump, {len(report.unknown)} unknown files.</p>"
                 f"<h2>First divergence</h2><ul>")
    for k, key in report.first_divergence.items():
        if key:
            r = by_key[key]
            parts.append(f"<li>step {k}: <b>{html.escape(r.name)}</b> ({r.role}, layer {r.layer}, op "
                         f"{html.escape(op_name(r.name, r.op))}): "
                         f"{html.escape(r.problem or '; '.join(r.failures))}"
                         + (f"<br>fault: <b>{html.escape(fault_line(r.fault))}</b> <small>(criterion: "
                            f"{html.escape(r.fault['criterion'])})</small>" if r.fault else "") + "</li>")
    if not any(report.first_divergence.values()):
        parts.append("<li>none</li>")
    parts.append("</ul>")
    if report.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in report.notes) + "</ul>")
    parts.append("<h2>Plots</h2>")
    for title, uri in {**plots(report, first_error), **fault_plots(fault_arrays)}.items():
        parts.append(f"<h3>{html.escape(title)}</h3><img alt='{html.escape(title)}' src='{uri}'>")
    parts.append("<h2>Tensors (worst first)</h2><table><tr><th>step</th><th>tensor</th><th>role</th><th>status</th>"
                 "<th>origin</th>" + "".join(f"<th>{c}</th>" for c in _COLUMNS) + "<th>note</th></tr>")
    first = set(report.first_divergence.values())
    for r in ordered(report):
        cls = "first" if r.key in first else ("fail" if r.status in FAILING else "")
        m = r.metrics or {}
        parts.append(f"<tr class='{cls}'><td>{r.step}</td><td>{html.escape(r.name)}</td><td>{r.role}</td>"
                     f"<td>{r.status}</td><td>{r.origin or ''}</td>"
                     + "".join(f"<td>{fmt(m.get(c), c)}</td>" for c in _COLUMNS)
                     + f"<td>{html.escape(r.problem or '; '.join(r.failures))}</td></tr>")
    parts.append("</table>")
    if report.unknown:
        parts.append("<h2>Unknown files</h2><ul>" + "".join(f"<li>{html.escape(u)}</li>" for u in report.unknown)
                     + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)
