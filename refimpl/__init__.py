"""refimpl: the pure-NumPy reference implementation of the Qwen3 family for NPU bring-up."""

from . import errors
from .formats.tokenizer import Tokenizer, load_tokenizer
from .generate import Generation, generate
from .load import load
from .models.config import ModelConfig, config_from_dict, load_config
from .models.model import Model
from .precision import Policy
from .trace import trace
from .version import __version__

__all__ = ["load", "load_tokenizer", "generate", "Generation", "Tokenizer", "trace", "Model", "Policy",
           "ModelConfig", "config_from_dict", "load_config", "errors", "__version__"]
