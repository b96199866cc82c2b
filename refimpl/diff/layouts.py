"""The layouts a device may dump a tensor in, and the readings of a dumped array the diff tries against the golden.

    found = candidates(item, rec, declared=None, conv_kernel=4)   # [(reading or None, array in the golden layout)]

A reading is None (as is), an adapter of ADAPTERS (a layout mix-up: transposed, NHWC, AIMET's layer-output layout)
or a layout of PyTorch module hooks (refimpl.diff.hooks).
"""

import math

from . import hooks


def _swap_last(shape):
    return (*shape[:-2], shape[-1], shape[-2]) if len(shape) >= 2 else None


def _aimet_shape(shape, axes):
    s = shape if (axes or "").split(",")[0] == "b" else (1, *shape)
    return (s[0], s[2], s[3], s[1]) if len(s) == 4 else s


def _aimet_inverse(a, shape, axes):
    if a.ndim == 4:
        a = a.transpose(0, 3, 1, 2)
    return a if (axes or "").split(",")[0] == "b" else a[0]


# adapter -> (device shape from the golden shape/axes, device array -> golden layout, description)
ADAPTERS = {
    "transposed": (lambda s, ax: _swap_last(s), lambda a, s, ax: a.swapaxes(-1, -2),
                   "last two axes swapped (e.g. key cache [.., t, d] for [.., d, t], state [dv, dk] for [dk, dv])"),
    "nhwc": (lambda s, ax: (s[0], s[2], s[3], s[1]) if len(s) == 4 else None,
             lambda a, s, ax: a.transpose(0, 3, 1, 2), "NHWC for NCHW (4-D)"),
    "aimet": (_aimet_shape, _aimet_inverse, "AIMET layer-output layout (batch axis added, 4-D as NHWC)"),
}


def candidates(item, rec, declared: str | None, conv_kernel: int | None = None):
    """[(reading or None, array in the golden layout)] to try, the likeliest first (replay takes the first). A tap
    is also tried in the layouts of module hooks (refimpl.diff.hooks: flattened rows, [B, H, T, D], channels-first
    conv), first when its hook name implies one; `declared` is an adapter of ADAPTERS, "hf-hooks" (the dump comes
    from module hooks: their layouts first) or a reading recorded earlier (e.g. "hf-hooks:reshape").
    conv_kernel: the model's causal conv width (padded conv outputs)."""
    shape, axes, a = tuple(rec["shape"]), rec.get("axes"), item.array
    flat = a.ndim == 1 and len(shape) != 1 and a.size == math.prod(shape)  # a raw file: the bundle's shape
    tap = rec["role"] == "tap"
    out = []
    hooked, source = [], getattr(item, "reading", None)
    if tap and (declared is None or declared.startswith(hooks.DECLARED)):
        hooked = hooks.readings(a, rec["name"], shape, conv_kernel, source)
    hooked_names = [h for h, _ in hooked]
    if declared is None and not source:  # as is, as hooked, then the mix-ups
        names = [None, *hooked_names, *ADAPTERS]
    elif declared in (None, hooks.DECLARED):  # the hook layouts first (the one its source implies, if named)
        names = [*hooked_names, None, *ADAPTERS]
    else:
        names = [declared]
    hooked = dict(hooked)
    for name in names:
        if name is None:
            if flat or a.shape == shape or (a.size == math.prod(shape)
                                            and [n for n in a.shape if n != 1] == [n for n in shape if n != 1]):
                out.append((None, a.reshape(shape)))
            continue
        if name.startswith(hooks.DECLARED):
            if name in hooked:
                out.append((name, hooked[name]))
            continue
        dev_shape, inverse, _ = ADAPTERS[name]
        ds = dev_shape(shape, axes)
        if ds is None or math.prod(ds) != math.prod(shape):
            continue
        if flat or a.shape in (tuple(ds), shape):  # its own shape, or its bytes in the contract's buffer
            g = inverse(a.reshape(ds), shape, axes)
            if g.shape == shape:
                out.append((name, g))
    return out


def conv_kernel(cfg) -> int | None:
    """The causal conv width of a hybrid model (hook dumps of its padded conv), else None."""
    return cfg.linear_conv_kernel_dim if cfg is not None and cfg.is_hybrid else None
