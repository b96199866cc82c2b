"""Golden bundles: a model, a prompt and a device convention -> every graph call's inputs, outputs and taps,
written as a bundle (refimpl/bundle.py, docs/bundle.md).

Numerics: float32 goldens are the same bits on every platform (correctly rounded products, sums and elementary
functions: docs/numerics.md), whatever BLAS kernel, thread count or SIMD path computes them, so BLAS uses all
its threads. platform.json beside the manifest records where a bundle was made, for information only.
"""

import dataclasses
import platform

import numpy as np
from threadpoolctl import threadpool_info

from .bundle import SCHEMA_VERSION, Tensor, write_bundle
from .conventions import CONVENTIONS
from .errors import FormatError, InputError, brief
from .generate import greedy, log_softmax_at
from .models.config import config_from_dict
from .version import __version__

try:    # NumPy >= 2 names the CPU features it dispatches on here; older NumPy: not recorded
    from numpy._core._multiarray_umath import __cpu_features__ as _CPU_FEATURES
except ImportError:
    _CPU_FEATURES = None



def run_convention(model, prompt_ids, convention: str = "hf", params: dict | None = None, decode_steps: int = 0,
                   taps: str | None = None, decode_ids: list | None = None):
    """The convention's graph calls and its checked, resolved options. params: Options fields.
    decode_ids: the tokens the decode calls feed (teacher forcing, e.g. another bundle's generated ids: an
    emulated-precision bundle that follows the golden's tokens); default each call's greedy choice."""
    if convention not in CONVENTIONS:
        raise InputError(f"unknown convention {convention!r}; choose one of {', '.join(CONVENTIONS)}")
    module = CONVENTIONS[convention]
    fields = {f.name for f in dataclasses.fields(module.Options)}
    unknown = sorted(set(params or {}) - fields)
    if unknown:
        raise InputError(f"convention {convention!r} has no option {unknown[0]!r} "
                         f"(options: {', '.join(sorted(fields)) or 'none'})")
    if not isinstance(decode_steps, int) or decode_steps < 0:
        raise InputError(f"decode steps must be a non-negative integer, got {decode_steps!r}")
    if decode_ids is not None:
        decode_ids = [int(t) for t in decode_ids]
        if len(decode_ids) < decode_steps or not all(0 <= t < model.config.vocab_size for t in decode_ids):
            raise InputError(f"decode ids: {decode_steps} ids in [0, {model.config.vocab_size}) expected, got "
                             f"{len(decode_ids)} ({decode_ids[:8]})")
    opts = module.Options(**(params or {}))
    n_prompt = np.asarray(prompt_ids).size
    limit = model.config.max_position_embeddings
    if n_prompt + decode_steps > limit:
        raise InputError(f"prompt ({n_prompt} tokens) + decode steps ({decode_steps}) = {n_prompt + decode_steps} "
                         f"exceeds the model's context limit (max_position_embeddings {limit})")
    calls = module.run(model, prompt_ids, opts, decode_steps=decode_steps, taps=taps, decode_ids=decode_ids)
    # the options as run, model-dependent defaults (pad id, conv state length) filled in: what the manifest records
    return calls, opts.resolved(model)


def run_graph(model, manifest: dict, inputs: dict) -> dict:
    """One graph call of a bundle's convention on given inputs (replay, explain): the golden's own inputs
    reproduce its outputs bit for bit."""
    conv = manifest.get("convention") or {}
    name, params = conv.get("name"), conv.get("params") or {}
    if not isinstance(name, str) or name not in CONVENTIONS or not isinstance(params, dict):
        raise FormatError(f"bundle manifest: convention {brief(conv)} is not one of {', '.join(CONVENTIONS)} with "
                          f"its params (replay and explain run the bundle's graph)")
    module = CONVENTIONS[name]
    try:
        opts = module.Options(**params)
    except TypeError as e:
        raise FormatError(f"bundle manifest: convention.params of {name}: {brief(str(e), 120)}") from None
    opts.check(model)
    return module.graph(model, inputs, opts)


def manifest_config(manifest: dict):
    """The model config a bundle's manifest records (replay, explain and the quantised diff rebuild the graph)."""
    config = (manifest.get("model") or {}).get("config")
    if config is None:
        raise FormatError("bundle manifest: no model.config (a bundle refimpl golden wrote records it)")
    return config_from_dict(config)


def bundle_steps(result: list, codes: dict | None = None) -> list[list[Tensor]]:
    """Each call's tensors. codes: {tap: Encoding} of the taps whose integer codes are also written, as taps
    `<tap>.codes` (uint8 / uint16, int8 / int16 for signed grids) right after the tap."""
    steps = []
    for c in result:
        tensors = [Tensor(n, "input", a, c.axes.get(n), c.valid.get(n)) for n, a in c.inputs.items()]
        tensors += [Tensor(n, "output", a, c.axes.get(n), c.valid.get(n)) for n, a in c.outputs.items()]
        for n, a in c.taps.items():
            tensors.append(Tensor(n, "tap", a, None, c.valid.get(n)))
            enc = (codes or {}).get(n)
            if enc is not None and enc.float_dtype is None:
                tensors.append(Tensor(f"{n}.codes", "tap", enc.codes(a).astype(enc.code_dtype), None, c.valid.get(n),
                                      {"codes_of": n}))
        steps.append(tensors)
    return steps


def generation_record(result: list, n_prompt: int, forced: bool = False) -> dict:
    """The host loop's token choices, one per call from the last prompt call on: the greedy token of that call's
    logits at its last real position, and its log-probability. tokens[:-1] are the generated ids (fed back as the
    next calls' inputs); the last one is what the final call predicts."""
    steps, positions, tokens, logprobs = [], [], [], []
    for k in range(n_prompt - 1, len(result)):
        c = result[k]
        logits = c.outputs["logits"][0]                                  # [T, V]
        box = c.valid.get("logits")                                       # [[[0, 1], [lo, hi], [0, V]]] when padded
        position = box[0][1][1] - 1 if box else logits.shape[0] - 1
        token = greedy(logits[position])
        steps.append(k)
        positions.append(int(position))
        tokens.append(token)
        logprobs.append(log_softmax_at(logits[position], token))
    fed = [t for c in result[n_prompt:] for t in c.tokens]
    assert forced or tokens[:-1] == fed, "the convention fed back other tokens than the greedy choices"
    record = {"rule": "greedy: argmax of the logits output at the step's last real position, ties to the lowest id; "
                      "logprob = log_softmax(logits) at the token, in float64",
              "steps": steps, "positions": positions, "tokens": tokens, "logprobs": logprobs}
    if forced:
        record["fed"] = "teacher forcing: the decode calls fed generated_ids, given, not these greedy choices"
    return record


def write_golden(out_dir, model, prompt_ids, *, source: str, convention: str = "hf", params: dict | None = None,
                 decode_steps: int = 0, taps: str | None = None, exports=(), aimet: bool = False,
                 overwrite: bool = False, progress=None, codes: bool = False, decode_ids: list | None = None):
    """Compute and write one golden bundle; returns its path. codes: with activation encodings, also write each
    output-quantised tap as its integer codes (`<tap>.codes`). decode_ids: see run_convention."""
    result, opts = run_convention(model, prompt_ids, convention, params, decode_steps, taps, decode_ids)
    prompt = [int(t) for t in np.asarray(prompt_ids).reshape(-1)]  # checked by the convention
    n_prompt = sum(c.graph in ("prompt", "prefill") for c in result)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "refimpl_version": __version__,
        "model": {"source": source, "config": model.config.to_dict(), "weights_sha256": model.weights.sha256()},
        "convention": {"name": convention, "params": dataclasses.asdict(opts)},
        "precision": model.precision.to_dict(),
        "prompt_ids": prompt,
        "generated_ids": [t for c in result[n_prompt:] for t in c.tokens],
        "generation": generation_record(result, n_prompt, decode_ids is not None),
        "steps": [{"index": k, "graph": c.graph, "tokens": c.tokens} for k, c in enumerate(result)],
        "taps": taps,
    }
    if model.config.is_hybrid and convention != "hf":
        manifest["convention"]["gdn_padding"] = "pad steps leave the conv and recurrent state untouched"
    if model.quantisers or model.precision.encodings is not None:
        manifest["quantisation"] = {"encodings": manifest["precision"]["encodings"],
                                    **model.quantisers.describe(model.modules)}
    if codes and not model.quantisers.outputs:
        raise InputError("--codes needs activation encodings that quantise some tap (an encodings file with "
                         "activation_encodings)")
    return write_bundle(out_dir, manifest, bundle_steps(result, model.quantisers.output_taps() if codes else None),
                        exports=exports, aimet=aimet, overwrite=overwrite, progress=progress,
                        platform=platform_fingerprint())


def platform_fingerprint() -> dict:
    """Where a bundle was made (NumPy, BLAS library and kernel, SIMD features), for information only: nothing in
    a float32 bundle depends on it."""
    simd = None if _CPU_FEATURES is None else sorted(name for name, on in _CPU_FEATURES.items() if on)
    blas = [{k: lib.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
            for lib in threadpool_info() if lib.get("user_api") == "blas"]
    return {"numpy": np.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "blas": blas, "simd": simd, "note": "for information only: nothing in a float32 bundle depends on it"}
