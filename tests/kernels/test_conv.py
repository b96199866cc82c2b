"""Causal depthwise conv1d with a carried state: gated_deltanet.md §5 and invariant C1, and parity with
transformers' causal_conv1d_fn / causal_conv1d_update (float32, oracle)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.errors import InputError
from refimpl.kernels.conv import causal_conv1d, causal_conv1d_step


def make(seed, B=2, C=6, T=9, Kc=4, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, C, T)).astype(dtype), rng.standard_normal((C, Kc)).astype(dtype)


def naive_conv(x, w, activation=True):
    """y[b, c, t] = silu( sum_j w[c, j] * x[b, c, t - (Kc-1) + j] ), zeros before t = 0; one scalar at a time."""
    B, C, T = x.shape
    Kc = w.shape[1]
    y = np.zeros((B, C, T))
    for b in range(B):
        for c in range(C):
            for t in range(T):
                s = sum(w[c, j] * x[b, c, t - (Kc - 1) + j] for j in range(Kc) if t - (Kc - 1) + j >= 0)
                y[b, c, t] = s / (1 + np.exp(-s)) if activation else s
    return y


def last_columns(x, n):
    """The last n columns of x along time, left-padded with zeros: what a conv state must hold."""
    B, C, T = x.shape
    return np.concatenate([np.zeros((B, C, max(0, n - T)), x.dtype), x[:, :, max(0, T - n):]], axis=2)


@pytest.mark.parametrize("Kc", [1, 2, 3, 4])
@pytest.mark.parametrize("activation", ["silu", None])
def test_formula_against_naive_loop(Kc, activation):
    x, w = make(Kc, Kc=Kc)
    y, state = causal_conv1d(x, w, activation=activation)
    assert y.shape == x.shape and state.shape == (2, 6, Kc)  # transformers keeps Kc columns
    assert np.max(np.abs(y - naive_conv(x, w, activation is not None))) <= 1e-12
    assert np.array_equal(state, last_columns(x, Kc))


@settings(max_examples=30, deadline=None)
@given(Kc=st.sampled_from([2, 3, 4]), extra=st.sampled_from([-1, 0, 3]), T=st.integers(1, 12), data=st.data(),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16))
def test_c1_prefill_then_steps_equals_full_conv(Kc, extra, T, data, dtype, seed):
    """C1: a prefill of P tokens, then shift-register steps with state_len in {Kc-1, Kc, Kc+3}, equals one full
    causal conv + SiLU bit for bit; every state equals the last state_len raw inputs exactly."""
    state_len = Kc + extra
    P = data.draw(st.integers(0, T), label="prefill")
    x, w = make(seed, T=T, Kc=Kc, dtype=dtype)
    y_full, _ = causal_conv1d(x, w, state_len=state_len)
    state = np.zeros((2, 6, state_len), dtype) if P == 0 else None
    ys = []
    if P:
        y, state = causal_conv1d(x[:, :, :P], w, state_len=state_len)
        ys.append(y)
    for t in range(P, T):
        y, state = causal_conv1d_step(x[:, :, t], w, state)
        ys.append(y[:, :, None])
        assert state.shape == (2, 6, state_len) and np.array_equal(state, last_columns(x[:, :, :t + 1], state_len))
    assert np.array_equal(np.concatenate(ys, axis=2), y_full)
    assert state.dtype == dtype and np.array_equal(state, last_columns(x, state_len))


@settings(max_examples=20, deadline=None)
@given(Kc=st.sampled_from([2, 3, 4]), T=st.integers(2, 12), data=st.data(), seed=st.integers(0, 2**16))
def test_multi_token_continuation_sees_the_stored_left_context(Kc, T, data, seed):
    """transformers' later multi-token call: concat(stored Kc columns, new tokens); same as one call."""
    a = data.draw(st.integers(1, T - 1), label="split")
    x, w = make(seed, T=T, Kc=Kc)
    y_full, s_full = causal_conv1d(x, w)
    y1, s1 = causal_conv1d(x[:, :, :a], w)
    y2, s2 = causal_conv1d(x[:, :, a:], w, s1)
    assert np.array_equal(np.concatenate([y1, y2], axis=2), y_full) and np.array_equal(s2, s_full)


def test_only_the_last_kc_minus_1_state_columns_matter():
    x, w = make(1, T=3)
    state = np.random.default_rng(2).standard_normal((2, 6, 4))
    y, s = causal_conv1d(x, w, state)
    y_short, s_short = causal_conv1d(x, w, state[:, :, 1:])  # llama.cpp / causal-conv1d keep Kc - 1 columns
    assert np.array_equal(y, y_short) and np.array_equal(s[:, :, 1:], s_short)
    assert not np.allclose(y, causal_conv1d(x, w)[0])  # and the state is used


def test_dtypes():
    x, w = make(3, dtype=np.float16)
    y, s = causal_conv1d(x, w.astype(np.float32))
    assert y.dtype == np.float16 and s.dtype == np.float16  # y in x's dtype; the state holds raw inputs
    assert np.array_equal(s, x[:, :, -4:])
    y64, _ = causal_conv1d(x.astype(np.float64), w.astype(np.float64))
    assert y64.dtype == np.float64


def test_bad_input_raises_input_error():
    x, w = make(4)
    with pytest.raises(InputError, match="weight"):
        causal_conv1d(x, w[:5])
    with pytest.raises(InputError, match="state"):
        causal_conv1d(x, w, np.zeros((2, 6, 2)))  # fewer than Kc - 1 = 3 columns
    with pytest.raises(InputError, match="state_len"):
        causal_conv1d(x, w, state_len=2)
    with pytest.raises(InputError, match="activation"):
        causal_conv1d(x, w, activation="gelu")
    with pytest.raises(InputError, match="one token"):
        causal_conv1d_step(x, w, np.zeros((2, 6, 4)))


# ---------------------------------------------------------------- parity with transformers (float32)


@pytest.mark.oracle
@pytest.mark.parametrize("Kc", [2, 3, 4])
def test_parity_with_transformers(hf, Kc):
    """causal_conv1d_fn (F.conv1d with Kc-1 zero padding, then silu) for the prefill, then causal_conv1d_update
    for single-token decode with transformers' Kc-column state (compared exactly)."""
    torch, m = hf
    x, w = make(Kc, B=2, C=24, T=11, Kc=Kc, dtype=np.float32)
    P = 7
    with torch.no_grad():
        y_t = m.causal_conv1d_fn(torch.from_numpy(x[:, :, :P]), torch.from_numpy(w), None, activation="silu")
        state_t = torch.from_numpy(np.ascontiguousarray(x[:, :, P - Kc:P]))  # the cache's last Kc raw inputs
        steps_t = [m.causal_conv1d_update(torch.from_numpy(x[:, :, t:t + 1]), state_t, torch.from_numpy(w),
                                          None, "silu") for t in range(P, 11)]
    y, state = causal_conv1d(x[:, :, :P], w)
    assert np.max(np.abs(y - y_t.numpy())) <= 1e-6
    for t, y_step_t in zip(range(P, 11), steps_t):
        y_step, state = causal_conv1d_step(x[:, :, t], w, state)
        assert np.max(np.abs(y_step - y_step_t.numpy()[:, :, 0])) <= 1e-6
    assert np.array_equal(state, state_t.numpy())
