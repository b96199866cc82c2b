"""Models and tokenizers from their sources: refimpl.load (a preset name, an HF checkpoint directory or a .gguf file
-> Model) and refimpl.load_tokenizer (a model, preset, vocabulary, directory, tokenizer.json or .gguf -> Tokenizer)."""

from pathlib import Path

from . import presets
from .errors import InputError
from .formats.device_encodings import read_device_encodings
from .formats.gguf import load_gguf
from .formats.safetensors import read_checkpoint
from .formats.tokenizer import MODEL_VOCAB, VOCABS, Tokenizer, gguf_tokenizer, qwen_tokenizer, tokenizer_from_json
from .models.config import load_config, read_generation_config
from .models.model import Model
from .precision import policy

DTYPES = ("float32", "float64")


def load(source: str | Path, dtype: str = "float32", precision=None, strict: bool = True,
         max_resident_bytes: int | None = None) -> Model:
    """precision: a refimpl.precision.Policy, an activation dtype name ("bf16", "fp16", ...) or a dict of
    Policy fields; default `dtype` (float32, or the float64 oracle). Giving both must not disagree.
    strict: a GGUF tensor of a type that cannot be read is an error here (default), else when it is read.
    max_resident_bytes: the most converted weight bytes held at once; tensors beyond it are converted per layer
    (per routed expert) each time they run. Default: everything is kept when the converted model fits in half
    of the machine's memory, else streamed under 1 GiB (refimpl/models/weights.py)."""
    if dtype not in DTYPES:
        raise InputError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    p = policy(precision if precision is not None else dtype)
    if dtype == "float64" and p.dtype != "float64":
        raise InputError(f"dtype 'float64' contradicts precision {p.activations!r}; give one of them")
    if str(source) in presets.PRESETS:
        return presets.build(str(source), precision=p, max_resident_bytes=max_resident_bytes)
    path = Path(source)
    if path.suffix.lower() == ".gguf":
        config, arrays = load_gguf(path, strict)
        return Model.from_arrays(config, arrays, str(path), p, max_resident_bytes, device=read_device_encodings(p))
    if not path.exists():
        raise InputError(f"{source}: not a preset ({', '.join(presets.PRESETS)}) and no such file or directory")
    if not path.is_dir():
        raise InputError(f"{path}: expected an HF checkpoint directory (config.json + *.safetensors)")
    config = load_config(path)
    arrays, origins = read_checkpoint(path)
    model = Model.from_arrays(config, arrays, str(path), p, max_resident_bytes, origins, read_device_encodings(p))
    model.generation_config = read_generation_config(path)
    return model


def load_tokenizer(source) -> Tokenizer:
    """The tokenizer of a model source: a loaded Model, a preset name, a vocabulary name (qwen3 | qwen3.5), an HF
    checkpoint directory (its tokenizer.json), a tokenizer.json file, or a .gguf file (its embedded vocabulary)."""
    if hasattr(source, "config") and hasattr(source, "weights"):     # a Model: go back to where it came from
        return load_tokenizer(model_source(source))
    name = str(source)
    if name in presets.PRESETS:
        return qwen_tokenizer(MODEL_VOCAB[presets.PRESETS[name]["model_type"]])
    if name in VOCABS:
        return qwen_tokenizer(name)
    path = Path(name)
    if path.suffix.lower() == ".gguf":
        return gguf_tokenizer(path)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise InputError(f"{path}: no tokenizer.json in this directory; give a tokenizer source explicitly "
                             f"(a tokenizer.json, or {', '.join(VOCABS)})")
        path = path / "tokenizer.json"
    if path.is_file():
        return tokenizer_from_json(path)
    raise InputError(f"{source}: not a preset ({', '.join(presets.PRESETS)}), vocabulary ({', '.join(VOCABS)}), "
                     f"directory or tokenizer file")


def model_source(model) -> str:
    """Where a loaded model came from (its weights' source: preset, checkpoint directory or file); a model built
    in memory gets the vocabulary of its architecture."""
    src = model.weights.source
    if src.startswith("preset:"):
        return src[len("preset:"):]
    if src != "<memory>" and Path(src).exists():
        return src
    if model.config.model_type in MODEL_VOCAB:
        return MODEL_VOCAB[model.config.model_type]
    raise InputError("this model does not say where it came from; call load_tokenizer with a source")
