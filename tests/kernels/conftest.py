import pytest


@pytest.fixture(scope="module")
def hf():
    """(torch, transformers' qwen3_next modeling module): the oracle for the GDN and conv kernels."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    return torch, m
