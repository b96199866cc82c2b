"""`refimpl compare-logits` output: a rich table on the terminal and a self-contained HTML report with plots."""

import html
import math

import numpy as np
from rich.console import Console
from rich.table import Table

from ..diff.report import figure_png


def _pm(d: dict, scale: float = 1.0, fmt: str = ".6f", unit: str = "") -> str:
    return f"{scale * d['value']:{fmt}} ± {scale * d['uncertainty']:{fmt}}{unit}"


def _column(r: dict) -> dict:
    """One column's statistics (the exact report or its llama_cpp part) as text, keyed by row name."""
    k, dp = r["kld"], r["p_diff"]
    out = {"Mean PPL(device)": _pm(r["ppl"]), "Mean PPL(reference)": _pm(r["ppl_reference"]),
           "Cor(ln PPL(device), ln PPL(reference))": "-" if r["ppl_correlation"] is None
           else f"{100 * r['ppl_correlation']:.2f} %",
           "Mean ln(PPL(device) / PPL(reference))": _pm(r["ln_ppl_ratio"]),
           "Mean PPL(device) / PPL(reference)": _pm(r["ppl_ratio"]),
           "Mean PPL(device) − PPL(reference)": _pm(r["ppl_difference"]),
           "Mean KLD": f"{k['mean']:.6f} ± {k['uncertainty']:.6f}"}
    out.update({f"{name} KLD": f"{k[key]:.6f}" for name, key in KLD_ROWS})
    out.update({"Mean Δp": f"{100 * dp['mean']:.3f} ± {100 * dp['uncertainty']:.3f} %",
                "Maximum / median / minimum Δp": f"{100 * dp['max']:.3f} / {100 * dp['median']:.3f} / "
                                                  f"{100 * dp['min']:.3f} %",
                "RMS Δp": _pm(r["rms_p_diff"], 100, ".3f", " %"),
                "Same top p (top-1 agreement)": _pm(r["same_top"], 100, ".3f", " %")})
    return out


KLD_ROWS = (("Maximum", "max"), ("99.9 %", "p99.9"), ("99.0 %", "p99"), ("95.0 %", "p95"), ("90.0 %", "p90"),
            ("Median", "median"), ("10.0 %", "p10"), ("5.0 %", "p5"), ("1.0 %", "p1"), ("0.1 %", "p0.1"),
            ("Minimum", "min"))
COLUMNS = ("refimpl (exact KL divergence)", "llama.cpp's definition (llama-perplexity)")


def rows(report: dict) -> list[tuple[str, str, str]]:
    """(statistic, exact value, llama.cpp's definition) in llama-perplexity's order and wording; "" where a
    statistic has no llama.cpp counterpart (docs/dataset.md: which is which and why they differ)."""
    exact = _column(report)
    ll = _column(report["llama_cpp"]) if "llama_cpp" in report else {}
    b = report["kld_bound"]
    out = [("Scored tokens", f"{report['tokens']} ({report['windows']['compared']} windows × "
                             f"{report['scored_per_window']})", "")]
    for name, value in exact.items():
        out.append((name, value, ll.get(name, "")))
        if name == "Mean PPL(device) − PPL(reference)":
            out.append(("  95 % interval", f"{report['ppl_difference']['ci95'][0]:.6f} … "
                                           f"{report['ppl_difference']['ci95'][1]:.6f}", ""))
        if name == "Minimum KLD":
            out.append(("KLD error of the compact reference", f"mean ≤ {b['mean']:.2e}, any percentile ≤ "
                                                              f"{b['max']:.2e}", ""))
    out.append((f"Top-{report['top_k']} overlap", f"{100 * report['topk_overlap']:.3f} %", ""))
    return out


def print_report(report: dict, failures: list, console: Console | None = None, worst: int = 5) -> None:
    console = console or Console()
    t = Table(title=f"device {report['device']} vs reference {report['reference']} ({report['model']})")
    t.add_column("statistic")
    for c in COLUMNS:
        t.add_column(c, justify="right")
    for row in rows(report):
        t.add_row(*row)
    console.print(t)
    w = Table(title="largest KLD (drill down: the `drill_down` command of each in --json / --html)")
    for c in ("window", "position", "KLD", "target", "reference top-1", "device top-1"):
        w.add_column(c, justify="right")
    for p in report["worst_positions"][:worst]:
        w.add_row(str(p["window"]), str(p["position"]), f"{p['kld']:.6g}", str(p["target"]),
                  str(p["reference_top1"]), str(p["device_top1"]))
    console.print(w)
    for note in report["notes"]:
        console.print(f"note: {note}")
    for f in failures:
        console.print(f"[red]FAIL[/red] {f}")


def plots(report: dict) -> dict:
    import matplotlib  # lazy: matplotlib is heavy, and only the HTML report draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = {}
    kld = np.asarray(report["kld_values"], dtype=np.float64)
    kld = kld[np.isfinite(kld)]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    positive = kld[kld > 0]
    if len(positive):
        ax.hist(positive, bins=np.logspace(math.log10(positive.min()), math.log10(positive.max()) + 1e-9, 60))
        ax.set_xscale("log")
    ax.set_xlabel("KL divergence per scored token (nats)")
    ax.set_ylabel("tokens")
    for key, style in (("median", "--"), ("p99", ":")):
        if report["kld"][key] > 0:
            ax.axvline(report["kld"][key], color="k", linestyle=style, label=f"{key} {report['kld'][key]:.3g}")
    ax.legend()
    out["KLD histogram"] = figure_png(fig)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    curve = report["per_position"]
    ax.plot(curve["position"], curve["mean_kld"], label="mean over windows")
    ax.plot(curve["position"], curve["max_kld"], alpha=0.5, label="max over windows")
    ax.set_yscale("log")
    ax.set_xlabel("position in the window")
    ax.set_ylabel("KLD (nats)")
    ax.legend()
    out["KLD per position"] = figure_png(fig)
    return out


def render_html(report: dict, failures: list) -> str:
    esc = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>refimpl compare-logits</title><style>"
             "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:100%}.bad{color:#b00}.pass{color:#070}"
             "code.cmd{font-size:10px;word-break:break-all}</style></head><body>",
             f"<h1>refimpl compare-logits</h1><p>device <code>{esc(report['device'])}</code> vs reference "
             f"<code>{esc(report['reference'])}</code> (model <code>{esc(report['model'])}</code>)</p>",
             "<p>Verdict: " + ("<b class='bad'>" + esc("; ".join(failures)) + "</b>" if failures else
                               "<b class='pass'>every policy bar met</b>" if report.get("policy", {}).get("bars") else
                               "no --policy bars given") + "</p>"]
    if report["notes"]:
        parts.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in report["notes"]) + "</ul>")
    parts.append("<h2>Statistics</h2><table><tr><th>statistic</th>" + "".join(f"<th>{esc(c)}</th>" for c in COLUMNS)
                 + "</tr>" + "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in row) + "</tr>"
                                     for row in rows(report)) + "</table><h2>Plots</h2>")
    for title, uri in plots(report).items():
        parts.append(f"<h3>{esc(title)}</h3><img alt='{esc(title)}' src='{uri}'>")
    parts.append("<h2>Windows with the largest mean KLD</h2><table><tr><th>window</th><th>mean KLD</th>"
                 "<th>max KLD</th></tr>" + "".join(f"<tr><td>{w['window']}</td><td>{w['mean_kld']:.6g}</td>"
                                                   f"<td>{w['max_kld']:.6g}</td></tr>"
                                                   for w in report["worst_windows"]) + "</table>")
    parts.append("<h2>Positions with the largest KLD</h2><table><tr><th>window</th><th>position</th><th>KLD</th>"
                 "<th>target</th><th>reference top-1</th><th>device top-1</th><th>drill down</th></tr>")
    for p in report["worst_positions"]:
        parts.append(f"<tr><td>{p['window']}</td><td>{p['position']}</td><td>{p['kld']:.6g}</td>"
                     f"<td>{p['target']}</td><td>{p['reference_top1']}</td><td>{p['device_top1']}</td>"
                     f"<td><code class='cmd'>{esc(p['drill_down'])}</code></td></tr>")
    parts.append("</table></body></html>")
    return "\n".join(parts)
