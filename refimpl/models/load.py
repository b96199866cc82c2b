"""refimpl.load: a preset name, an HF checkpoint directory, or a .gguf file -> Model."""

from pathlib import Path

from ..errors import InputError
from ..formats.safetensors import read_checkpoint
from .config import load_config
from .model import Model
from .weights import Weights

DTYPES = ("float32", "float64")


def load(source: str | Path, dtype: str = "float32") -> Model:
    if dtype not in DTYPES:
        raise InputError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    from . import presets
    if str(source) in presets.PRESETS:
        return presets.build(str(source), dtype=dtype)
    path = Path(source)
    if path.suffix.lower() == ".gguf":
        from ..formats.gguf import load_gguf
        config, arrays = load_gguf(path)
        return Model(config, Weights(arrays, dtype=dtype, source=str(path)))
    if not path.exists():
        raise InputError(f"{source}: not a preset ({', '.join(presets.PRESETS)}) and no such file or directory")
    if not path.is_dir():
        raise InputError(f"{path}: expected an HF checkpoint directory (config.json + *.safetensors)")
    config = load_config(path)
    arrays, _ = read_checkpoint(path)
    return Model(config, Weights(arrays, dtype=dtype, source=str(path)))
