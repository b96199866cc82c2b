"""Forks: a top-k choice a reduced-precision device makes the other way at a near tie of its router, judged as a
fork of the computation, not as a fault (docs/diff.md, "Ties and forks").

    why, what = fork(golden, emulated, device, chosen, (golden_ids, emulated_ids), k=4, rounding_nmse=2**-22 / 3)
    # why None: that token's choice is a fork (what says why); else why says what refuses it

Three-way judging lets an integer tensor equal the golden or the emulation. A token whose router logits are
ill-conditioned (a near tie of two experts, closer than the device's honest error there) may be routed by an honest
device to neither's experts: its logits carry the same honest error as the emulation's, another realisation of it,
and the top-k of those logits is another expert. The tensors after it then follow another, equally valid
computation. One token's choice is such a fork when all of these hold (compare.py checks them per token, and
divergence.localise accepts the fork only if the device's router logits pass three-way as a tensor):

    1. the device's chosen experts are distinct ids and exactly the top-k of its own router logits at that token
       (a top-k inconsistent with its own logits is a fault of the top-k, never a fork);
    2. the device's router logits at that token are within k x the emulation's error there, in RMS over the experts:
       mean (d - g)^2 <= k^2 N,   N = max(mean (e - g)^2, rounding_nmse mean g^2)   (one rounding at least);
    3. for the golden and the emulation alike, the margin by which it preferred the experts the device dropped to
       those it took is within what that error moves a difference of two logits:
       max_dropped l - min_taken l <= k sqrt(2 N)
       (one logit's honest error has RMS up to k sqrt(N); a difference of two, sqrt(2) times that).
"""

import math

import numpy as np


def fork(golden, emulated, device, chosen, references, k: float, rounding_nmse: float) -> tuple[str | None, str]:
    """(None, what the fork is) when one token's choice of experts is a fork of its router logits (module
    docstring), else (why not, ""). golden, emulated, device: that token's router logits [E]; chosen: the device's
    expert ids [top-k]; references: (the golden's ids, the emulation's ids); k: three-way's k; rounding_nmse: the
    NMSE of one rounding to the device dtype (policy.ROUNDING_NMSE)."""
    g, e, d = (np.asarray(x, np.float64).reshape(-1) for x in (golden, emulated, device))   # [E] logits
    ids, n = [int(i) for i in np.asarray(chosen).reshape(-1)], g.size
    if len(set(ids)) != len(ids) or not all(0 <= i < n for i in ids):
        return f"experts {ids} are not {len(ids)} distinct ids under {n}", ""
    if not (np.isfinite(d).all() and np.isfinite(e).all() and np.isfinite(g).all()):
        return "its router logits are not finite", ""
    others = [j for j in range(n) if j not in ids]
    low = min(d[i] for i in ids)                                         # the device's k-th logit
    if others and max(d[j] for j in others) > low:                       # 1. the top-k of its own logits
        j = max(others, key=lambda j: d[j])
        return (f"experts {sorted(ids)} are not the top-{len(ids)} of the device's own router logits (expert {j}: "
                f"{d[j]:.6g} > {low:.6g})"), ""
    noise = max(float(np.mean((e - g) ** 2)), rounding_nmse * float(np.mean(g * g)))   # N: the emulation's MSE there
    error = float(np.mean((d - g) ** 2))                                 # the device's MSE there
    if error > k * k * noise:                                            # 2. within k x the emulation's, in RMS
        return (f"its router logits there are {math.sqrt(error / noise):.3g} x the emulation's error (RMS), over "
                f"k = {k:g}"), ""
    allowed = k * math.sqrt(2 * noise)                                   # k sqrt(2 N): a difference of two logits
    worst, took = 0.0, []
    for what, ref, logits in (("golden", references[0], g), ("emulation", references[1], e)):
        ref = [int(i) for i in np.asarray(ref).reshape(-1)]
        took.append(f"{what} {sorted(ref)}")
        taken = [i for i in ids if i not in ref]
        dropped = [i for i in ref if i not in ids and 0 <= i < n]
        if not taken or not dropped:
            continue
        margin = max(logits[i] for i in dropped) - min(logits[i] for i in taken)   # 3. max_dropped - min_taken
        if margin > allowed:
            return (f"the {what} preferred experts {sorted(dropped)} to {sorted(taken)} by {margin:.3g}, over "
                    f"k sqrt(2) x the emulation's error there ({allowed:.3g})"), ""
        worst = max(worst, margin)
    return None, (f"experts {sorted(ids)} ({', '.join(took)}): the top-{len(ids)} of the device's own router logits, "
                  f"a margin of {worst:.3g} within {allowed:.3g}")
