"""Dataset statistics of the device against the reference, as llama.cpp's `llama-perplexity --kl-divergence`
defines them (tools/perplexity/perplexity.cpp, `kl_divergence`), over n scored tokens, in float64:

    mean and uncertainty of x:   m = sum(x) / n,  u = sqrt((sum(x^2) / n - m^2) / (n - 1))   (0 if n <= 10)
    covariance of means:         cov = (sum(a b) / n - mean(a) mean(b)) / (n - 1)            (0 if n < 10)
    PPL = exp(mean NLL) +- PPL * u(NLL)            (device: PPL(Q); reference: PPL(base))
    ln(PPL(Q) / PPL(base)) = mean(NLL) - mean(NLL_base) +- sqrt(u^2 + u_base^2 - 2 cov)
    PPL(Q) - PPL(base)    +- sqrt(u_PPL^2 + u_PPL(base)^2 - 2 PPL PPL(base) cov)
    KLD: mean +- u; median (mean of the two middle values for even n); percentile f of the sorted values:
         v[i] (1 - t) + v[i + 1] t with i + t = f (n - 1)
    dp = p_device(token) - p_reference(token): mean +- u, percentiles; RMS dp = sqrt(mean dp^2) +- u(dp^2) / (2 RMS)
    same top p: fraction of positions where the device's argmax is the reference's, +- sqrt(f (1 - f) / (n - 1))

These are the exact column of compare-logits: the reference NLL and top token exact (float64 from the
reference's float32 logits), the KLD over the renormalised stored distribution and every entry, everything in
float64. llama.cpp's definition of each (its 16-bit base rows as stored, entries at or below -16 nats left out of
the KLD, its float32 arithmetic) is the second column: llama.py, llama_rows and llama_summary.
"""

import math

import numpy as np

PERCENTILES = (0.999, 0.99, 0.95, 0.9, 0.1, 0.05, 0.01, 0.001)


def mean_and_uncertainty(x: np.ndarray) -> tuple[float, float]:
    n = len(x)
    if n < 1:
        return 0.0, 0.0
    m = math.fsum(x.tolist()) / n
    var = math.fsum((x * x).tolist()) / n - m * m
    return m, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def covariance(a: np.ndarray, b: np.ndarray) -> float:
    n = len(a)
    if n < 10:
        return 0.0
    return (math.fsum((a * b).tolist()) / n - math.fsum(a.tolist()) / n * (math.fsum(b.tolist()) / n)) / (n - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile: linear interpolation between the order statistics."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    t = p - i
    return float((1 - t) * sorted_values[i] + t * sorted_values[min(i + 1, len(sorted_values) - 1)])


def median(sorted_values: np.ndarray) -> float:
    n = len(sorted_values)
    return float(0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]) if n % 2 == 0 else sorted_values[n // 2])


def distribution(values: np.ndarray) -> dict:
    """mean +- uncertainty, min, median, max and the PERCENTILES of a per-token quantity."""
    v = np.sort(values)
    m, u = mean_and_uncertainty(values)
    return {"mean": m, "uncertainty": u, "min": float(v[0]), "median": median(v), "max": float(v[-1]),
            **{f"p{100 * f:g}": percentile(v, f) for f in PERCENTILES}}


def perplexities(nll: np.ndarray, nll_ref: np.ndarray) -> dict:
    """PPL(device), PPL(reference), their correlation, ln ratio, ratio and difference, each with its uncertainty
    as llama-perplexity propagates it, from the per-token NLLs (float64, one length n >= 1)."""
    log_ppl, log_ppl_ref = mean_and_uncertainty(nll), mean_and_uncertainty(nll_ref)
    cov = covariance(nll, nll_ref)
    ppl, ppl_ref = math.exp(log_ppl[0]), math.exp(log_ppl_ref[0])
    ppl_u, ppl_ref_u = ppl * log_ppl[1], ppl_ref * log_ppl_ref[1]
    ln_ratio = log_ppl[0] - log_ppl_ref[0]
    ln_ratio_u = math.sqrt(max(0.0, log_ppl[1] ** 2 + log_ppl_ref[1] ** 2 - 2 * cov))
    diff_u = math.sqrt(max(0.0, ppl_u ** 2 + ppl_ref_u ** 2 - 2 * ppl * ppl_ref * cov))
    return {
        "ppl": {"value": ppl, "uncertainty": ppl_u},
        "ppl_reference": {"value": ppl_ref, "uncertainty": ppl_ref_u},
        "ppl_correlation": cov / (log_ppl[1] * log_ppl_ref[1]) if log_ppl[1] and log_ppl_ref[1] else None,
        "ln_ppl_ratio": {"value": ln_ratio, "uncertainty": ln_ratio_u},
        "ppl_ratio": {"value": math.exp(ln_ratio), "uncertainty": math.exp(ln_ratio) * ln_ratio_u},
        "ppl_difference": {"value": ppl - ppl_ref, "uncertainty": diff_u,
                           "ci95": [ppl - ppl_ref - 1.959964 * diff_u, ppl - ppl_ref + 1.959964 * diff_u]},
    }


def summarise(kld: np.ndarray, nll: np.ndarray, nll_ref: np.ndarray, same_top: np.ndarray,
              overlap: np.ndarray, kld_bound: np.ndarray) -> dict:
    """Every statistic of the module docstring over per-token arrays (all of one length n >= 1)."""
    n = len(kld)
    p_diff = np.exp(-nll) - np.exp(-nll_ref)
    mse = mean_and_uncertainty(p_diff * p_diff)
    rms = math.sqrt(mse[0])
    top = float(np.mean(same_top))
    return {
        "tokens": n,
        **perplexities(nll, nll_ref),
        "kld": distribution(kld),
        "kld_bound": {"mean": float(np.mean(kld_bound)), "max": float(np.max(kld_bound)),
                      "meaning": "compact-form error: |mean KLD - exact| <= the mean bound; every order statistic "
                                 "(median, percentiles, max) is within the max bound"},
        "p_diff": distribution(p_diff),
        "rms_p_diff": {"value": rms, "uncertainty": 0.5 / rms * mse[1] if rms > 0 else 0.0},
        "same_top": {"value": top, "uncertainty": math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0},
        "topk_overlap": float(np.mean(overlap)),
    }
