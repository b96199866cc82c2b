"""Device I/O conventions: a prompt turned into the fixed-shape graph calls a device makes, with every input
and output named as that toolchain names it (device_conventions.md)."""

import numpy as np

from ..errors import FormatError


def state_shapes(cfg) -> tuple:
    """(conv, recurrent) state shapes of a linear-attention layer as graph inputs (Kc: the conv state's columns,
    an export option)."""
    return (1, cfg.conv_dim, "Kc"), (1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)


def check_inputs(inputs: dict, expected: dict, where: str) -> dict:
    """Graph inputs given from outside (a bundle's, a device's: replay, explain) against the names and shapes a
    convention's graph reads. expected: name -> shape, a size as an int, or as a letter that must agree wherever it
    recurs (AR, CL, ...). Returns the letters' sizes; FormatError naming the input otherwise."""
    sizes = {}
    for name, shape in expected.items():
        if name not in inputs:
            raise FormatError(f"{where}: graph input {name!r} is missing")
        got = np.shape(inputs[name])
        ok = len(got) == len(shape)
        for want, n in zip(shape, got) if ok else ():
            if isinstance(want, str):
                ok = ok and sizes.setdefault(want, n) == n
            else:
                ok = ok and want == n
        if not ok:
            shown = [sizes.get(s, s) if isinstance(s, str) else s for s in shape]
            raise FormatError(f"{where}: graph input {name!r} has shape {list(got)}, the graph reads {shown}")
    return sizes
