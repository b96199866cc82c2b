"""Causal depthwise conv1d with a carried state: the conv in front of the Gated DeltaNet core.

Spec: gated_deltanet.md §5, models.md §6.5 step 2 and §6.6. Layout is channels first, as transformers' mixed_qkv
after its transpose and the causal-conv1d package:

    x [B, C, T]    weight [C, Kc] (the checkpoint's [C, 1, Kc] squeezed)    state [B, C, state_len], state_len >= Kc - 1

    X = concat(left context, x) along time       left context: the state's last Kc - 1 columns, or zeros
    y[b, c, t] = silu( sum_{j=0}^{Kc-1} w[c, j] * X[b, c, t + j] )      (cross-correlation: w[c, Kc-1] multiplies
                                                                          the current token, w[c, 0] the oldest)
    new state  = last state_len columns of concat(state or zeros, x)     (raw pre-conv inputs, x's dtype)

transformers keeps state_len = Kc columns (only the last Kc - 1 affect any output); causal-conv1d's
initial/final states and llama.cpp keep Kc - 1. The same function serves a prefill (state None), a multi-token
continuation and a single-token decode (T = 1: the state is a shift register).
"""

import numpy as np

from ..errors import InputError
from .activation import identity, silu, unhooked


def causal_conv1d(x, weight, state=None, *, activation="silu", state_len=None, rnd=identity, at=unhooked):
    """Causal depthwise conv1d + activation over T new tokens, continuing from `state`.

    x [B, C, T]; weight [C, Kc]; state [B, C, S] with S >= Kc - 1, or None (zero left context).
    state_len: columns of the returned state; default S (the state's own length), or Kc without a state
    (transformers' convention). activation: "silu" (or "swish") or None.
    Returns y [B, C, T] in x's dtype and the new state [B, C, state_len] in x's dtype (raw inputs, exact).

    Computes in x's and weight's dtype promoted to at least float32, summing the Kc taps oldest first; transformers
    runs the conv in the weight dtype (e.g. bf16) and casts y to x's dtype: `rnd` (identity by default) emulates
    that, rounding the conv output and the activation's output. Point (`at`): x, the [state | x] columns read.
    """
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[1]:
        raise InputError(f"causal_conv1d: x must be [B, C, T] and weight [C, Kc]; got x {x.shape}, "
                         f"weight {weight.shape}")
    B, C, T = x.shape
    Kc = weight.shape[1]
    if state is not None and (state.shape[:2] != (B, C) or state.ndim != 3 or state.shape[2] < Kc - 1):
        raise InputError(f"causal_conv1d: state must be [B, C, >= Kc-1] = [{B}, {C}, >= {Kc - 1}]; "
                         f"got {state.shape}")
    if state_len is None:
        state_len = Kc if state is None else state.shape[2]
    if state_len < Kc - 1:
        raise InputError(f"causal_conv1d: state_len must be >= Kc - 1 = {Kc - 1}; got {state_len}")
    if activation not in ("silu", "swish", None):
        raise InputError(f"causal_conv1d: activation must be 'silu', 'swish' or None; got {activation!r}")

    if state is None:
        state = np.zeros((B, C, state_len), x.dtype)
    history = at("x", np.concatenate([state.astype(x.dtype, copy=False), x], axis=2))  # [B, C, S + T] oldest first

    dt = np.result_type(np.float32, x.dtype, weight.dtype)
    X = history[:, :, history.shape[2] - (Kc - 1) - T:].astype(dt)  # [B, C, Kc - 1 + T]
    w = weight.astype(dt)  # [C, Kc]
    y = w[:, 0, None] * X[:, :, 0:T]  # [B, C, T]
    for j in range(1, Kc):
        y += w[:, j, None] * X[:, :, j:j + T]  # y[t] += w[j] * x[t - (Kc-1) + j]
    y = rnd(y)
    if activation is not None:
        y = rnd(silu(y))

    if history.shape[2] < state_len:  # a longer state than the history: left-pad with zeros
        history = np.concatenate([np.zeros((B, C, state_len - history.shape[2]), x.dtype), history], axis=2)
    new_state = history[:, :, history.shape[2] - state_len:].copy()  # [B, C, state_len]
    return y.astype(x.dtype, copy=False), new_state


def causal_conv1d_step(x, weight, state, *, activation="silu"):
    """One decode step: the state as a shift register.  x [B, C], state [B, C, S] -> y [B, C], new state [B, C, S].

    X = concat(state, x); new state = last S columns of X; y = act(sum_j w[c, j] * X[c, S - (Kc-1) + j]).
    Equals causal_conv1d(x[:, :, None], weight, state) (transformers' causal_conv1d_update without the in-place
    write).
    """
    if x.ndim != 2:
        raise InputError(f"causal_conv1d_step: x must be one token [B, C]; got {x.shape}")
    y, new_state = causal_conv1d(x[:, :, None], weight, state, activation=activation)
    return y[:, :, 0], new_state
