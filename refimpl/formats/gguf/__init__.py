"""GGUF (llama.cpp) files, read and written as llama.cpp reads and writes them.

    reader.py      the binary header over a read-only memory map (GGUFFile, StringArray)
    ggml_types.py  ggml's tensor types, which refimpl reads as weights, dequantisation of the block types
    config.py      metadata -> the HF config.json dict it describes; where llama.cpp reads it otherwise
    names.py       llama.cpp's names of the HF tensors and the conversion transforms between the layouts
    tensors.py     the model's tensors under HF names, read lazily, transforms undone; load_gguf
    writer.py      write_gguf: a model in llama.cpp's names, layout and metadata, atomically
    tokenizer.py   the embedded vocabulary as plain data (tokenizer_metadata)

The names other modules use are re-exported here.
"""

from .ggml_types import type_name, unreadable
from .reader import GGUFFile
from .tensors import load_gguf
from .tokenizer import tokenizer_metadata
from .writer import write_gguf

__all__ = ["GGUFFile", "load_gguf", "write_gguf", "tokenizer_metadata", "type_name", "unreadable"]
