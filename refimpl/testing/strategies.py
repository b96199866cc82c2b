"""Hypothesis strategies of kernel test cases: each draws the arguments of a make_*_case builder (cases.py) and
yields a Case. Requires hypothesis (`pip install 'refimpl[testing]'`).

    from hypothesis import given
    from refimpl.testing.strategies import sdpa_cases

    @given(case=sdpa_cases(dtype="float16"))
    def test_my_sdpa(case):
        case.check(my_sdpa(**case.inputs))

dtype: one dtype, or a list to draw from. extreme=True widens magnitudes to where reduced precision breaks
(large attention scores, tiny / huge activations, very negative gates); the default magnitudes are the ones
models see. Arrays come from a drawn seed (fast, and shrinking still simplifies shapes and parameters).
"""

try:
    from hypothesis import strategies as st
except ImportError as e:  # hypothesis is optional for refimpl.testing: assert_close and the builders work without it
    raise ImportError("refimpl.testing.strategies needs hypothesis: pip install 'refimpl[testing]' "
                      "(or pip install 'hypothesis>=6.100')") from e

from .cases import (
    MASK_FLOORS,
    make_conv1d_case,
    make_gated_delta_case,
    make_moe_routing_case,
    make_rms_norm_case,
    make_rope_case,
    make_sdpa_case,
)

_SEEDS = st.integers(0, 2**32 - 1)


def _dtypes(dtype):
    return st.sampled_from(list(dtype)) if isinstance(dtype, (list, tuple)) else st.just(dtype)


@st.composite
def rope_cases(draw, dtype="float16", *, extreme=False, head_dims=(8, 16, 32, 64, 128, 256),
               rotary_fractions=(0.25, 0.5, 1.0), max_positions=(64, 4096, 262144, 1 << 20)):
    """Half-split RoPE cases: head dims, partial rotary (Qwen3-Next / 3.5 use 0.25), positions up to 2^20 (long
    contexts, where float32 angles lose bits), theta from 1e4 to 1e7. extreme: |x| ~ 1e-3 or 1e3 too."""
    mags = [1.0, 1e-3, 1e3] if extreme else [1.0]
    return make_rope_case(
        draw(_SEEDS), dtype=draw(_dtypes(dtype)), B=draw(st.integers(1, 2)), T=draw(st.integers(1, 5)),
        H=draw(st.integers(1, 3)), D=draw(st.sampled_from(head_dims)),
        rotary_fraction=draw(st.sampled_from(rotary_fractions)),
        theta=draw(st.sampled_from([1e4, 1e6, 1e7]) | st.floats(100.0, 1e7)),
        max_position=draw(st.sampled_from(max_positions)), magnitude=draw(st.sampled_from(mags)))


@st.composite
def sdpa_cases(draw, dtype="float16", *, extreme=False, max_len=12, gqa=(1, 2, 4), floors=MASK_FLOORS,
               head_dims=(8, 16, 32)):
    """Attention cases: Lq <= Lk (a cache continuation, offset = Lk - Lq), GQA ratios, sliding windows, left
    padding, masks filled with finfo.min, -inf, -50 or -1000. extreme: q and k scaled by 2-4, so scaled scores
    reach tens (exp overflows fp16 above 11.09: a softmax must subtract the row max)."""
    Lk = draw(st.integers(1, max_len))
    return make_sdpa_case(
        draw(_SEEDS), dtype=draw(_dtypes(dtype)), B=draw(st.integers(1, 2)), Hkv=draw(st.integers(1, 2)),
        n_rep=draw(st.sampled_from(gqa)), Lq=draw(st.integers(1, Lk)), Lk=Lk, D=draw(st.sampled_from(head_dims)),
        Dv=draw(st.sampled_from(head_dims)), window=draw(st.none() | st.integers(1, max_len)),
        padding=draw(st.booleans()), floor=draw(st.sampled_from(floors)),
        magnitude=draw(st.sampled_from([1.0, 2.0, 3.0, 4.0] if extreme else [1.0])))


@st.composite
def rms_norm_cases(draw, dtype="float16", *, variants=("plain", "zero_centered", "gated"), extreme=False):
    """RMSNorm cases over rows of 1-256 channels, eps 1e-6 / 1e-5. extreme: |x| ~ 1e-4 (eps dominates) or 1e3
    (x^2 overflows fp16: sum squares in fp32)."""
    shape = tuple(draw(st.lists(st.integers(1, 4), max_size=2))) + (draw(st.sampled_from([1, 7, 16, 64, 256])),)
    return make_rms_norm_case(
        draw(_SEEDS), dtype=draw(_dtypes(dtype)), shape=shape, variant=draw(st.sampled_from(list(variants))),
        eps=draw(st.sampled_from([1e-6, 1e-5])),
        magnitude=draw(st.sampled_from([1.0, 1e-4, 1e3] if extreme else [1.0, 0.1, 10.0])))


@st.composite
def gated_delta_cases(draw, dtype="float16", *, extreme=False, lengths=(1, 5, 16, 33, 64, 65),
                      chunk_sizes=(16, 64), l2norm_in_kernel=(True, False)):
    """Gated delta rule cases: GVA ratios 1/2/4, d_k != d_v, T around chunk boundaries, gates from fla's
    distribution with g_norm 0.1 / 1 / 10, shares of exactly-zero gates (gate 1) and very negative spikes (-20,
    or -1e3 with extreme), beta with exact 0 and 1 edges, with and without an initial state, q / k normalised in
    the kernel or beforehand. extreme: v and the state scaled by 1e-2 or 1e2, spikes of -1e3."""
    return make_gated_delta_case(
        draw(_SEEDS), dtype=draw(_dtypes(dtype)), B=draw(st.integers(1, 2)), T=draw(st.sampled_from(lengths)),
        Hk=draw(st.integers(1, 2)), r=draw(st.sampled_from([1, 2, 4])), Dk=draw(st.sampled_from([8, 16, 32])),
        Dv=draw(st.sampled_from([4, 12, 16])), g_norm=draw(st.sampled_from([0.1, 1.0, 10.0])),
        zero_gate=draw(st.sampled_from([0.0, 0.5, 1.0])), spikes=draw(st.sampled_from([0.0, 0.1])),
        spike_value=draw(st.sampled_from([-20.0, -1e3] if extreme else [-20.0])),
        beta_edges=draw(st.sampled_from([0.0, 0.2])), initial_state=draw(st.booleans()),
        use_qk_l2norm=draw(st.sampled_from(list(l2norm_in_kernel))), chunk_size=draw(st.sampled_from(chunk_sizes)),
        magnitude=draw(st.sampled_from([1.0, 1e-2, 1e2] if extreme else [1.0])))


@st.composite
def conv1d_cases(draw, dtype="float16", *, extreme=False, kernel_sizes=(2, 3, 4)):
    """Causal conv1d cases: a prefill (T up to 9) or a decode step (T = 1), with or without a carried state of
    Kc - 1, Kc or Kc + 3 columns. extreme: |x| ~ 1e-3 or 1e2."""
    Kc = draw(st.sampled_from(kernel_sizes))
    return make_conv1d_case(
        draw(_SEEDS), dtype=draw(_dtypes(dtype)), B=draw(st.integers(1, 2)), C=draw(st.sampled_from([1, 4, 8])),
        T=draw(st.sampled_from([1, 2, 5, 9])), Kc=Kc, state=draw(st.booleans()),
        state_len=Kc + draw(st.sampled_from([-1, 0, 3])),
        magnitude=draw(st.sampled_from([1.0, 1e-3, 1e2] if extreme else [1.0])))


@st.composite
def moe_routing_cases(draw, dtype="float16", *, ties=True, extreme=False):
    """Router cases: E 1-16 experts or the real counts (64, 128, 256, 512), top-k 1..min(E, 10), norm_topk_prob
    on / off, and (ties=True) integer logits with exact ties. extreme: logits of scale 30 (a peaked softmax)."""
    E = draw(st.one_of(st.integers(1, 16), st.sampled_from([64, 128, 256, 512])))
    return make_moe_routing_case(
        draw(_SEEDS), dtype=draw(_dtypes(dtype)), N=draw(st.integers(1, 8)), E=E,
        top_k=draw(st.integers(1, min(E, 10))),
        norm_topk_prob=draw(st.booleans()), ties=draw(st.booleans()) if ties else False,
        logit_scale=draw(st.sampled_from([0.1, 1.0, 30.0] if extreme else [0.1, 1.0])))
