"""refimpl: the pure-NumPy reference implementation of the Qwen3 family for NPU bring-up."""

from . import errors
from .formats.tokenizer import Tokenizer
from .generate import Generation, generate
from .models.config import ModelConfig, config_from_dict, load_config
from .models.model import Model
from .precision import Policy
from .sources import load, load_tokenizer
from .trace import trace
from .version import __version__

__all__ = ["load", "load_tokenizer", "generate", "Generation", "Tokenizer", "trace", "Model", "Policy",
           "ModelConfig", "config_from_dict", "load_config", "errors", "__version__"]
