"""refimpl on llama.cpp's GGUF conversion of a tiny HF checkpoint against transformers on that checkpoint
(float32, eager): logits <= 1e-4 (measured <= 6.7e-6 at logits of size ~8), all five architectures; and the HF side
of the cases where llama.cpp and transformers compute differently (gguf_cases.SEMANTICS): refimpl on the HF
checkpoint keeps transformers' semantics."""

import numpy as np
import pytest
from test_gguf import ARCHS, FIXTURES, IDS

import gguf_cases
import refimpl
from oracle import torch, transformers

pytestmark = pytest.mark.oracle


def _transformers_logits(case, directory):
    kwargs = {"attn_implementation": "eager"}
    if "moe" in case or "next" in case:   # the architectures with experts
        kwargs["experts_implementation"] = "eager"
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return hf(torch.as_tensor(IDS)).logits.numpy()


@pytest.mark.parametrize("name", sorted(gguf_cases.SEMANTICS))
def test_hf_side_of_the_semantic_differences_matches_transformers(name, tmp_path):
    """refimpl loading the HF checkpoint of each case (transformers' semantics: M-RoPE's uncovered pairs take the
    temporal position, l2norm eps 1e-6, YaRN's betas and attention factor) against transformers: <= 1e-4, while
    the GGUF of it, which runs as llama.cpp does (test_gguf.py::test_llamacpp_semantics), is elsewhere."""
    directory = gguf_cases.write_checkpoint(name, tmp_path / name)
    expected = _transformers_logits(name, directory)
    model = refimpl.load(directory)
    assert model.config.semantics == "transformers"
    logits = model.forward(IDS)
    assert np.abs(logits - expected).max() <= 1e-4
    gguf = refimpl.load(gguf_cases.write_semantics_gguf(name, tmp_path / f"{name}.gguf")).forward(IDS)
    assert np.abs(gguf - expected).max() > 20 * 1e-4


@pytest.mark.parametrize("case", ARCHS)
def test_gguf_logits_match_transformers(case, tmp_path):
    expected = _transformers_logits(case, gguf_cases.write_checkpoint(case, tmp_path / case))
    logits = refimpl.load(FIXTURES / f"{case}-f32.gguf").forward(IDS)
    assert np.abs(logits).max() > 1
    assert np.abs(logits - expected).max() <= 1e-4
