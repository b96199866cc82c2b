"""Per-channel judgement: a tensor's channels scored as well as the whole tensor (docs/diff.md, "Per channel").

    ch = channel_scores(golden, device, mask, sample_axes=(0, 1))    # [B, T, C]: channels = C; None if < 2
    ch["worst"], ch["nmse"], ch["gain"], ch["rest_nmse"]              # its worst channel
    channel_bar(ch, max_nmse)                                         # that channel's bar (policy.judge applies it)
    ch["gain_worst"], ch["gain_z2"], ch["gain_q"], ch["gain_offset"]  # the gain test's worst channel (z2 / s_c)
    gain_failure(ch, max_nmse)                                        # its verdict (policy.judge applies it)

A wrong per-channel scale (one output channel of a projection 2 % off: the most common quantisation bug) moves the
tensor's NMSE by 4e-4 / C for C channels, under any bar fp16 noise needs, while that channel's own NMSE is 4e-4.
So each channel (an index over the tensor's feature axes: everything but its batch and token axes) is judged too:

    channel c  (n_c valid elements over batch and tokens, e = device - golden, E = the emulated run three-way)
        nmse_c  = sum e^2 / (n_c max(mean g^2 of c, P))   P: the tensor's mean g^2 (a channel that sits near 0 is
                                                         judged at the tensor's scale, as judged_nmse does for steps)
        rest_c  = the NMSE of the other channels
        gain_c  = sum e g / sum g^2                      its signed error relative to its values (+0.02 for x1.02)
    fails when  nmse_c > max(max_nmse, CONTRAST q(n_c, C) rest_c, CONTRAST nmse_c(E))
        q(n, C) = chi2_n^-1(1 - ALPHA / C) / n

the tensor's own bar (max_nmse: the dtype default, a policy's, three-way's k^2 x the emulation's), its contrast
with the rest of the same tensor (were the rest's error spread evenly, a channel's nmse over n elements would be
rest x chi2_n / n: q is the quantile the worst of C channels stays under with probability 1 - ALPHA, Bonferroni
over the channels; CONTRAST = k^2 with three-way's k = 4 allows an honest unevenness of 4 in RMS beyond chance),
and (three-way) k x the emulated run's own error on that channel (an honest bf16 / fp16 GDN decode step puts most
of its error in a few elements, the emulation in the same ones). The worst channel is the one of the largest
nmse_c / max(q rest_c, nmse_c(E)). q is 4.9 for n = 7, C = 64; 3.65 for n = 16, C = 1024; 18.7 for one token
and 64 channels: a decode step's channels carry little evidence, a prompt's much. Tensors without a token axis (the
GDN states, taken whole) and tensors of one channel are not judged per channel.

The gain test. nmse_c spends its evidence on every direction an error can take; a wrong per-channel scale takes one,
the channel's own values (e = (c - 1) g). So each channel is also tested along g, off the emulation, each sample t
(a batch x token index) weighed by the noise the other channels show at that same sample:

    delta = device - E (E = golden without an emulation), less each sample's own gain along g (leave one out over
            the sample's other channels: a token's common gain, a norm's or a softmax's denominator, is no channel's)
    w_c   = max(mean g^2 of c, P)                                               the channel's scale, as nmse_c's
    a_tc  = max(sum_{c' != c} delta^2 / w, sum_{c' != c} (E - g)^2 / w) / (C_t - 1)   sample t's noise level
    z_c   = sum_t delta g / (a w)  /  sqrt(sum_t g^2 / (a w))                  weighted least squares: ~ N(0, 1)
    gain off the emulation = sum_t delta g / (a w) / sum_t g^2 / (a w)
    s_c   = max(1, mean of z_c'^2 over the other tested channels c')    the noise model's scale, from the data
    fails when  z_c^2 / s_c > GAIN_CONTRAST F^-1_{1, k-1}(1 - ALPHA / C)  and  nmse_c > gain_guard
                (three-way: max_nmse / CONTRAST, the emulation's own NMSE; else max_nmse)

(the worst channel by z_c^2 / s_c among the k channels with >= GAIN_MIN_N elements; tensors of fewer than
GAIN_MIN_CHANNELS channels and softmax probabilities, `gain_tested`, are not gain-tested). An honest error is
independent of the channel's own values once the emulation's share is taken off, so z_c is normal with the noise
model's variance; the per-sample noise a_tc keeps a token that is ill-conditioned for the whole tensor (a
near-cancellation every channel of a head carries) from reading as a gain of one channel. Where the model
understates every channel's variance alike (errors correlated over tokens: a recurrence carries one token's error
into the next, along the same values; honest GDN `core` / `conv1d_silu` / `norm` tensors on the HTP had a mean z^2
of 3-5 over their channels, projections 0.9-1.3), the other channels show it: z_c^2 / s_c is then F(1, k - 1)
whatever that common scale (s_c is never taken under 1, the model's own), and the worst of C channels stays under
its quantile at ALPHA / C. A x1.02 channel over n tokens has z^2 ~ 0.02^2 n / (the rest's NMSE off the
emulation). GAIN_CONTRAST (4: k = 2 in RMS beyond chance) leaves honest tails room (docs/diff.md, "Per channel":
the worst honest channel of every HTP run at 1.43 of the quantile); the channel must also carry more error than
the tensor's bar allows its whole at k = 1 (three-way: max_nmse / CONTRAST, the emulation's own NMSE; without an
emulation, the dtype's bar), so a significant but negligible gain (host-given RoPE tables, 1e-17 off) is no fault.
"""

import functools
import math

import mpmath
import numpy as np

from ..conventions.common import tap_token_axis

ALPHA = 1e-3   # the chance an honest tensor fails on its worst channel by chance (policy.small_sample's level)
CONTRAST = 16  # k^2, k = 4 (three-way's default): a channel may stand out from the rest by k in RMS beyond chance
GAIN_CONTRAST = 4   # the gain test's allowance beyond chance (k = 2 in RMS: docs/diff.md, "Per channel")
GAIN_MIN_N = 2      # one element per channel (a decode call) tells a gain from any error no better than nmse_c
GAIN_MIN_CHANNELS = 8   # a sample's noise is estimated from the tensor's other channels: at least 7 of them
PROBABILITIES = ("attn_probs", "router_probs")   # softmax outputs: channels are key slots / experts, not gain-tested


def gain_tested(name: str) -> bool:
    """Whether a tensor's channels take the gain test: not a softmax's probabilities, whose channels (key slots,
    experts) are no projection's output channels and whose errors follow the device's Softmax kernel (the HTP's is
    up to 20 ulp off, value by value: honest runs scored up to 11 there)."""
    return not name.endswith(PROBABILITIES)


@functools.lru_cache(maxsize=4096)
def chi2_quantile(n: int, tail: float) -> float:
    """x with P(chi2_n > x) = tail (regularized upper incomplete gamma Q(n/2, x/2), solved by bisection in x)."""
    if not tail > 0:
        return math.inf
    mpmath.mp.dps = 20
    return _upper_quantile(lambda x: mpmath.gammainc(n / 2, x / 2, mpmath.inf, regularized=True), tail,
                           max(8.0 * n, 16.0))


@functools.lru_cache(maxsize=4096)
def f_quantile(d1: int, d2: int, tail: float) -> float:
    """x with P(F(d1, d2) > x) = tail: P(F > x) = I_{d2 / (d2 + d1 x)}(d2 / 2, d1 / 2) (regularized incomplete beta),
    solved by bisection in x."""
    if not tail > 0:
        return math.inf
    mpmath.mp.dps = 20
    return _upper_quantile(lambda x: mpmath.betainc(d2 / 2, d1 / 2, 0, d2 / (d2 + d1 * x), regularized=True), tail,
                           16.0)


def _upper_quantile(upper, tail: float, hi: float) -> float:
    """x with upper(x) = tail, upper a decreasing upper-tail probability, by bisection on [0, hi] (hi doubled until
    upper(hi) <= tail) to a relative width of 1e-7; the upper end, so P(> x) <= tail."""
    lo = 0.0
    while upper(hi) > tail:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if upper(mid) > tail:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-7 * hi:
            break
    return hi


def q_factor(n: int, count: int, alpha: float = ALPHA) -> float:
    """How far the worst of `count` channels of n elements each may exceed the tensor's NMSE by chance:
    chi2_n^-1(1 - alpha / count) / n."""
    n = max(int(n), 1)
    return chi2_quantile(n, alpha / max(int(count), 1)) / n


def channel_bar(ch: dict, max_nmse: float) -> float:
    """The worst channel's bar: max(the tensor's bar, CONTRAST x q(n, C) x the NMSE of the tensor's other
    channels, CONTRAST x the emulation's NMSE on that channel (three-way))."""
    return max(max_nmse, CONTRAST * q_factor(ch["n"], ch["count"]) * ch["rest_nmse"],
               CONTRAST * (ch.get("emulated_nmse") or 0.0))


def sample_axes(rec: dict) -> tuple | None:
    """The batch and token axes of a bundle tensor (its channels are the other axes), or None when it has no token
    axis (a state taken whole, token ids): a tap's by its name, a graph input's or output's by its `axes`."""
    if rec["role"] == "tap":
        axis = tap_token_axis(rec["name"])
        return None if axis is None or len(rec["shape"]) <= axis else tuple(sorted({0, axis}))
    axes = (rec.get("axes") or "").split(",")
    if "t" not in axes or len(axes) != len(rec["shape"]):
        return None
    return tuple(sorted({axes.index(a) for a in ("b", "t") if a in axes}))


def channel_scores(golden, device, mask, sample_axes: tuple, emulation=None, gain: bool = True) -> dict | None:
    """The worst channel of a tensor, scored (module docstring), or None when it has fewer than 2 channels with a
    valid, finite element. golden, device: arrays of one shape; mask: bool, the valid region; sample_axes: the
    batch and token axes (the rest are channels). Keys: count (channels scored), worst (its index over the channel
    axes), n, mse, power, nmse (its own: mse / power), gain, tensor_power (P), rest_nmse, emulated_nmse (the
    emulation's nmse_c, three-way; else None), contrast (nmse_c / max(q rest_c, nmse_c(E)), the largest)."""
    g, d = np.asarray(golden, np.float64), np.asarray(device, np.float64)
    axes = [a for a in range(g.ndim) if a not in sample_axes]
    if not axes:
        return None
    order = [*sample_axes, *axes]
    feature_shape = [g.shape[a] for a in axes]
    e = g if emulation is None else np.asarray(emulation, np.float64)
    g, d, e, ok = (np.transpose(x, order).reshape(-1, math.prod(feature_shape)) for x in (g, d, e, np.asarray(mask)))
    ok = ok & np.isfinite(g) & np.isfinite(d) & np.isfinite(e)                         # [S, C]
    n = ok.sum(axis=0)                                                                 # [C]
    scored = n > 0
    count = int(scored.sum())
    if count < 2:
        return None
    peak = float(max(np.max(np.abs(g[ok])), np.max(np.abs(d[ok])))) if ok.any() else 0.0
    s = 2.0 ** math.floor(math.log2(peak)) if peak > 0 else 1.0                        # exact scaling: no overflow
    gs, es = np.where(ok, g / s, 0.0), np.where(ok, (d - g) / s, 0.0)
    err = np.sum(es * es, axis=0)                                                      # sum e^2 per channel
    ee = np.where(ok, (e - g) / s, 0.0)
    err_emulated = np.sum(ee * ee, axis=0)                                             # the emulation's (three-way)
    power = np.sum(gs * gs, axis=0)                                                    # sum g^2 per channel
    cross = np.sum(es * gs, axis=0)                                                    # sum e g per channel
    P = float(power.sum() / n.sum())                                                   # mean g^2 of the tensor
    m = np.maximum(n, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        den = m * np.maximum(power / m, P)
        judged, emulated = err / den, err_emulated / den                               # nmse_c at the floor P
        rest = (err.sum() - err) / (power.sum() - power)                               # the other channels' nmse
        q = np.array([q_factor(k, count) for k in m]) if len(set(m.tolist())) > 1 else q_factor(int(m[0]), count)
        expected = np.maximum(q * np.nan_to_num(rest, posinf=0.0), emulated)
        score = np.where(scored, np.nan_to_num(judged / expected, nan=0.0, posinf=np.inf), -np.inf)
    c = int(np.argmax(score))
    k = int(n[c])
    out = {
        "count": count,
        "worst": [int(i) for i in np.unravel_index(c, feature_shape)],
        "n": k,
        "mse": float(err[c] / k) * s * s,
        "power": float(power[c] / k) * s * s,
        "nmse": float(err[c] / power[c]) if power[c] > 0 else (0.0 if err[c] == 0 else math.inf),
        "gain": float(cross[c] / power[c]) if power[c] > 0 else math.nan,
        "tensor_power": P * s * s,
        "rest_nmse": float(rest[c]) if np.isfinite(rest[c]) else 0.0,
        "emulated_nmse": float(emulated[c]) if emulation is not None else None,
        "contrast": float(score[c]),
    }
    if not gain:
        return out
    return out | gain_test(gs, es, ee if emulation is not None else None, ok, n, power, P, count, feature_shape, s)


def gain_test(gs, es, ee, ok, n, power, P, count: int, feature_shape, s: float) -> dict:
    """The gain test (module docstring): each channel's signed error along its own values, off the emulation's, in
    units of the noise the other channels show at the same samples. gs, es, ee: golden, device - golden,
    emulation - golden (None: no emulation), [S, C], scaled by s, 0 where not valid (ok, bool [S, C]); n, power:
    [C]; P: the tensor's mean g^2. Keys gain_*: of the channel with the largest z^2 among those of >= GAIN_MIN_N
    elements; none when fewer than GAIN_MIN_CHANNELS channels are scored."""
    if count < GAIN_MIN_CHANNELS:
        return {}
    dl = _less_sample_gain(es if ee is None else es - ee, gs)                          # delta = device - emulation
    ee = None if ee is None else _less_sample_gain(ee, gs)
    m = np.maximum(n, 1)
    if not P > 0:
        return {}
    w = np.maximum(power / m, P)                                                       # w_c = max(mean g^2 of c, P)
    R = dl * dl / w                                                                    # delta^2 / w_c      [S, C]
    Rm = np.zeros_like(R) if ee is None else ee * ee / w                               # (E - g)^2 / w_c    [S, C]
    others = np.maximum(ok.sum(axis=1, keepdims=True) - 1, 1)                          # other channels of sample t
    a = np.maximum(R.sum(axis=1, keepdims=True) - R, Rm.sum(axis=1, keepdims=True) - Rm) / others   # a_tc: noise
    v = np.maximum(a, 2.0 ** -80) * w                                                  # var delta_tc = a_tc w_c
    num = np.sum(dl * gs / v, axis=0)                                                  # sum delta g / v
    den = np.sum(gs * gs / v, axis=0)                                                  # sum g^2 / v
    with np.errstate(divide="ignore", invalid="ignore"):
        z2 = num * num / den                                                           # z_c^2 ~ chi2_1 (honest)
        offset = num / den                                                             # the channel's gain, weighted
    tested = (n >= GAIN_MIN_N) & (den > 0)
    z2 = np.where(tested, np.nan_to_num(z2, nan=0.0, posinf=np.inf), 0.0)
    k = int(tested.sum())
    if k < 2:
        return {}
    with np.errstate(invalid="ignore"):
        scale = np.maximum((z2.sum() - z2) / (k - 1), 1.0)                             # s_c: the others' mean z^2
    judged = np.where(tested, np.nan_to_num(z2 / scale, nan=np.inf), -np.inf)          # z_c^2 / s_c ~ F(1, k - 1)
    c = int(np.argmax(judged))
    m = int(n[c])
    return {
        "gain_worst": [int(i) for i in np.unravel_index(c, feature_shape)],
        "gain_n": m,
        "gain_mse": float(np.sum(es[:, c] ** 2) / m) * s * s,
        "gain_power": float(power[c] / m) * s * s,
        "gain_offset": float(offset[c]),
        "gain_z2": float(judged[c]),
        "gain_scale": float(scale[c]),
        "gain_q": f_quantile(1, k - 1, ALPHA / count),
    }


def _less_sample_gain(x, gs):
    """x less each sample's own gain along g, estimated from the sample's other channels (leave one out): an error
    common to a whole token in proportion to its values (a norm's or a softmax's denominator off) is no gain of
    any one channel.  x, gs [S, C] -> [S, C]"""
    xg, gg = x * gs, gs * gs
    with np.errstate(divide="ignore", invalid="ignore"):
        beta = (xg.sum(axis=1, keepdims=True) - xg) / (gg.sum(axis=1, keepdims=True) - gg)   # beta_tc
    return x - np.nan_to_num(beta, nan=0.0, posinf=0.0, neginf=0.0) * gs              # x - beta_tc g


def gain_failure(ch: dict, max_nmse: float, reference_power: float | None = None) -> str | None:
    """The gain test's verdict on a tensor's channels (None: passes): its channel fails when z^2 > GAIN_CONTRAST q1
    and its nmse (judged as judged_channel_nmse) fails the tensor's bar max_nmse."""
    if "gain_z2" not in ch or not ch["gain_z2"] > GAIN_CONTRAST * ch["gain_q"]:
        return None
    nmse = judged_channel_nmse({"mse": ch["gain_mse"], "power": ch["gain_power"],
                                "tensor_power": ch["tensor_power"]}, reference_power)
    guard = gain_guard(ch, max_nmse)
    if not nmse > guard:
        return None
    return (f"channel {ch['gain_worst']} of {ch['count']}: gain {100 * ch['gain_offset']:+.2f} % off the emulation's, "
            f"z^2 {ch['gain_z2']:.3g} > {GAIN_CONTRAST * ch['gain_q']:.3g}, nmse {nmse:.3g} > {guard:.3g}")


def gain_guard(ch: dict, max_nmse: float) -> float:
    """The least nmse_c a channel the gain test finds must carry to fail: three-way (an emulated run's error on the
    channels, ch["emulated_nmse"]), the tensor's bar over k^2, the emulated run's own NMSE: a gain bigger than one
    honest realisation's whole error; else (the dtype's bar, replay's op-local judgement) that bar itself, which
    holds no k^2 (an op the HTP computes with a 0.09 % channel gain against refimpl's fp16 replay is rounding)."""
    return max_nmse / CONTRAST if ch.get("emulated_nmse") is not None else max_nmse


def gain_floor(ch: dict, floor: float, nmse: float) -> float:
    """The NMSE floor a channel the gain test failed is classified against (refimpl.diff.classify): the noise the
    tensor's channels carry, at the chance level of the worst of C (q(n_c, C) x the tensor's NMSE, nmse), within the
    gain test's magnitude guard and the tensor's floor (its bar): min(floor, max(gain_guard, q nmse)). A gain the
    test finds under the tensor's bar is fitted against the channel's own noise, not against that bar."""
    return min(floor, max(gain_guard(ch, floor), q_factor(ch["gain_n"], ch["count"]) * nmse))


def whitened(golden, device, mask, axes: tuple) -> tuple:
    """golden and device with each sample (a batch x token index) divided by the RMS error the tensor's channels
    show there (on their scale w_c, as the gain test weighs samples; its mean over samples kept), and the NMSE of
    the whole so weighed: a channel the gain test failed is classified on the samples as that test weighed them,
    not on a few ill-conditioned tokens' error. -> (golden', device', nmse'), float64 of golden's shape"""
    g, d = np.asarray(golden, np.float64), np.asarray(device, np.float64)
    feature = tuple(a for a in range(g.ndim) if a not in axes)
    ok = np.asarray(mask) & np.isfinite(g) & np.isfinite(d)
    g0, e0 = np.where(ok, g, 0.0), np.where(ok, d - g, 0.0)
    P = float(np.sum(g0 * g0) / max(int(ok.sum()), 1))                                # the tensor's mean g^2
    w = np.maximum(np.sum(g0 * g0, axis=axes, keepdims=True) / np.maximum(ok.sum(axis=axes, keepdims=True), 1), P)
    a = np.sum(e0 * e0 / w, axis=feature, keepdims=True) / np.maximum(ok.sum(axis=feature, keepdims=True), 1)
    level = float(np.mean(a[a > 0])) if np.any(a > 0) else 1.0                         # a_t: sample t's noise
    k = 1.0 / np.sqrt(np.maximum(a / level, 1e-12))                                    # 1 / sqrt(a_t / mean a)
    gw, dw = g * k, d * k
    power = float(np.sum(np.where(ok, gw, 0.0) ** 2))
    nmse = float(np.sum(np.where(ok, dw - gw, 0.0) ** 2) / power) if power > 0 else 0.0
    return gw, dw, nmse


def judged_channel_nmse(ch: dict, reference_power: float | None = None) -> float:
    """The worst channel's nmse as judged: its mse over the larger of its power and the tensor's (reference_power:
    the power the tensor's bar divides by, when larger than the step's own, e.g. the run's)."""
    floor = max(ch["tensor_power"], reference_power or 0.0)
    den = max(ch["power"], floor)
    if not den > 0:
        return 0.0 if ch["mse"] == 0 else math.inf
    return ch["mse"] / den
