"""refimpl on llama.cpp's GGUF conversion of a tiny HF checkpoint against transformers on that checkpoint
(float32, eager): logits <= 1e-4 (measured <= 6.7e-6 at logits of size ~8), all five architectures."""

import numpy as np
import pytest

import gguf_cases
import refimpl

from oracle import torch, transformers
from test_gguf import ARCHS, FIXTURES, IDS

pytestmark = pytest.mark.oracle


@pytest.mark.parametrize("case", ARCHS)
def test_gguf_logits_match_transformers(case, tmp_path):
    directory = gguf_cases.write_checkpoint(case, tmp_path / case)
    kwargs = {"attn_implementation": "eager"}
    if gguf_cases.CASES[case].get("num_experts"):
        kwargs["experts_implementation"] = "eager"
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        expected = hf(torch.as_tensor(IDS)).logits.numpy()
    logits = refimpl.load(FIXTURES / f"{case}-f32.gguf").forward(IDS)
    assert np.abs(logits).max() > 1
    assert np.abs(logits - expected).max() <= 1e-4
