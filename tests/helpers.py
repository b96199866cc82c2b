"""Shared test helpers (no oracle)."""

import numpy as np

from refimpl.models.config import config_from_dict
from refimpl.models.model import Model
from refimpl.models.weights import Weights
from refimpl.presets import PRESETS, random_weights


def scaled(name: str, dtype="float32"):
    """A preset with its output projection scaled so logits are of size ~2 rather than ~40."""
    cfg = config_from_dict(PRESETS[name])
    arrays = random_weights(cfg, seed=11)
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    arrays[head] = arrays[head] * np.float32(0.05)
    return Model(cfg, Weights(arrays, dtype=dtype))
