"""AIMET's QuantizationSimModel on transformers models (test oracle only; skipped where aimet-torch is absent).

aimet_torch imports torchvision at module level (for vision ops its LLM path never uses), and PyPI's torchvision
does not load beside the CPU torch build these tests pin, so a stand-in module takes its place. transformers'
own torchvision probe runs first, so transformers still sees no torchvision.
"""

import functools
import importlib.machinery
import importlib.util
import json
import math
import sys
import time
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _torchvision_stand_in() -> None:
    try:
        import torchvision  # noqa: F401
        return
    except (ImportError, OSError, RuntimeError):  # absent, or a wheel built for another torch
        sys.modules.pop("torchvision", None)
    from transformers.utils import import_utils
    import_utils.is_torchvision_available()  # cached False before the stand-in exists
    tv = types.ModuleType("torchvision")
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    for sub in ("datasets", "transforms", "ops"):
        setattr(tv, sub, types.ModuleType(f"torchvision.{sub}"))
        sys.modules[f"torchvision.{sub}"] = getattr(tv, sub)
    tv.transforms.Resize = type("Resize", (), {})      # names aimet_torch reads at import time
    tv.ops.RoIPool = type("RoIPool", (), {})
    sys.modules["torchvision"] = tv


if importlib.util.find_spec("aimet_torch") is None:  # pragma: no cover - depends on the environment
    pytest.skip("aimet-torch unavailable (aimet-torch is not installed)", allow_module_level=True)


@functools.cache
def _aimet() -> types.SimpleNamespace:
    """aimet_torch's names, imported at the first use, not when the test modules are collected: its import (torch's
    dynamo, onnxscript and bokeh among it) takes seconds of CPU, which every pytest-xdist worker paid collecting
    test_aimet.py; now only the worker that runs the AIMET tests (xdist group "aimet") does. Skipped where aimet-torch
    does not import."""
    try:
        _torchvision_stand_in()
        from aimet_torch.common.defs import QuantScheme
        from aimet_torch.nn import BaseQuantizationMixin
        from aimet_torch.quantsim import QuantizationSimModel
    except ImportError as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"aimet-torch unavailable ({e})")
    return types.SimpleNamespace(QuantScheme=QuantScheme, BaseQuantizationMixin=BaseQuantizationMixin,
                                 QuantizationSimModel=QuantizationSimModel)


# every test of the AIMET oracle on one pytest-xdist worker (`make test`: --dist loadgroup), one import of aimet_torch
GROUP = pytest.mark.xdist_group("aimet")


class CausalLM(torch.nn.Module):
    """input_ids -> logits of a transformers causal LM, returning a tensor as QuantSim requires (transformers 5's
    return_dict=False path breaks in its CausalLM wrappers). Its children are the model's own `model` and `lm_head`,
    so every module keeps its HF path and AIMET names encodings by it."""

    def __init__(self, hf):
        super().__init__()
        self.model, self.lm_head = hf.model, hf.lm_head

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids=input_ids, use_cache=False).last_hidden_state)


_RUNNING = []    # the linear_attn modules of models given to conv1d_as_module whose forward is running (innermost last)
_ORIGINAL = {}   # transformers module name -> its own causal_conv1d_fn, before conv1d_as_module replaced it


def _enter(module, args):
    _RUNNING.append(module)


def _leave(module, args, output):
    _RUNNING.pop()


def _module_conv(original):
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        if not _RUNNING:   # a model conv1d_as_module was not given (another test's, on this worker): transformers'
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        out = _RUNNING[-1].conv1d(hidden_states)[:, :, :hidden_states.shape[-1]]
        return transformers.activations.ACT2FN[activation](out) if activation else out
    return conv


def conv1d_as_module(model) -> None:
    """Make each Gated DeltaNet run its conv1d *module* (so QuantSim quantises the conv's weight and output, as it
    does in a device graph), not transformers 5's causal_conv1d_fn on the raw weight, which bypasses AIMET's
    wrappers. Same arithmetic: conv1d with Kc - 1 zeros of padding, the first T outputs, then the activation.
    causal_conv1d_fn is a global of transformers' module: it takes this path only inside the forward of a
    linear_attn of a model given here, and is transformers' own for every other model the worker runs later (it
    used to run the last AIMET model's conv for them: a Qwen3.5 model of another width then failed in F.conv1d)."""
    for name, sub in model.named_modules():
        if name.endswith("linear_attn"):
            sub.register_forward_pre_hook(_enter)
            sub.register_forward_hook(_leave, always_call=True)   # popped even when the forward raises
    for name in [n for n in sys.modules if n.startswith("transformers.models.qwen3")]:
        if hasattr(sys.modules[name], "causal_conv1d_fn") and name not in _ORIGINAL:
            _ORIGINAL[name] = sys.modules[name].causal_conv1d_fn
            sys.modules[name].causal_conv1d_fn = _module_conv(_ORIGINAL[name])


def quantsim(model, calibration, param_bw: int, act_bw: int):
    """QuantizationSimModel (post_training_tf, AIMET's default config), calibrated on `calibration` (id arrays)."""
    ids = [torch.as_tensor(c) for c in calibration]
    aimet = _aimet()
    sim = aimet.QuantizationSimModel(model, dummy_input=ids[0], quant_scheme=aimet.QuantScheme.post_training_tf,
                               default_param_bw=param_bw, default_output_bw=act_bw)

    def run(m):
        with torch.no_grad():
            for c in ids:
                m(c)
    sim.compute_encodings(run)
    return sim


def save_legacy(sim, directory, name: str = "model") -> str:
    """The encodings as aimet-torch writes them for a torch model (0.6.1: module names, input / output)."""
    sim.save_encodings_to_json(str(directory), name)
    return str(directory / f"{name}.json")


def quantiser_values(sim, ids) -> tuple[np.ndarray, dict, dict]:
    """sim.model on ids: its logits; every enabled activation quantiser's (input, output) {(module, io, i):
    (array, array)}; and every quantised module's inputs as it received them, before its input quantisers
    {(module, i): array} (for a module that runs more than once, its last call)."""
    seen, received, hooks = {}, {}, []
    plain = lambda t: t.detach().as_subclass(torch.Tensor).numpy().copy()
    for name, module in sim.model.named_modules():
        if not isinstance(module, _aimet().BaseQuantizationMixin):
            continue

        def take(_, args, name=name):
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    received[name, i] = plain(a)
        hooks.append(module.register_forward_pre_hook(take))
        for io, qs in (("input", module.input_quantizers), ("output", module.output_quantizers)):
            for i, q in enumerate(qs):
                if q is not None:
                    def keep(_, args, out, key=(name, io, i)):
                        seen[key] = (plain(args[0]), plain(out))
                    hooks.append(q.register_forward_hook(keep))
    try:
        with torch.no_grad():
            logits = sim.model(torch.as_tensor(ids)).numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, seen, received


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------ refimpl against QuantSim

ARCHITECTURES = {  # tiny random models of each family (tests/oracle.build_hf randomises every parameter)
    "Qwen3": {"model_type": "qwen3", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "Qwen3-MoE": {"model_type": "qwen3_moe", "moe_intermediate_size": 12, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "Qwen3.5": {"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"],
                "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                    "mrope_section": [1, 1, 0], "mrope_interleaved": True}},
}
ARCHITECTURES["Qwen3.5-MoE"] = {**ARCHITECTURES["Qwen3.5"], "model_type": "qwen3_5_moe_text",
                                "moe_intermediate_size": 12, "shared_expert_intermediate_size": 20, "num_experts": 8,
                                "num_experts_per_tok": 2}
BASE = {"vocab_size": 97, "hidden_size": 48, "num_hidden_layers": 2, "intermediate_size": 40, "hidden_act": "silu",
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
MIXES = {"W8A16": (8, 16), "W4A16": (4, 16), "W8A8": (8, 8)}


def calibrated(arch: str, mix: str, directory, seed: int = 1, calibration: int = 4):
    """The tiny `arch` model (saved to directory/hf), its QuantSim at `mix` calibrated on `calibration` random
    16-token sequences, the saved legacy encodings file, and the random generator to draw evaluation ids from.
    -> (torch model, sim, encodings path, rng)"""
    from oracle import build_hf
    hf = build_hf({**BASE, **ARCHITECTURES[arch]}, seed=seed)
    hf.save_pretrained(directory / "hf")
    model = CausalLM(hf)
    if arch.startswith("Qwen3.5"):
        conv1d_as_module(model)
    rng = np.random.default_rng(seed)
    sim = quantsim(model, [rng.integers(0, BASE["vocab_size"], (1, 16)) for _ in range(calibration)], *MIXES[mix])
    return model, sim, save_legacy(sim, directory), rng


class Recording:
    """Wraps a refimpl model's quantisers: records each quantiser's (input, output) by (module, io, i).
    align: QuantSim's {(module, io, i): (input, output)}; where refimpl's code is one step from QuantSim's and the
    two float32 values in front of the quantiser are within 1 % of a step (the same value, rounded differently
    by two float orders, on either side of a rounding boundary), refimpl continues with QuantSim's value.
    `aligned` counts those elements."""

    def __init__(self, quantisers, align: dict | None = None):
        self.q, self.seen, self.align, self.aligned = quantisers, {}, align or {}, 0

    def __bool__(self):
        return bool(self.q)

    def input(self, module, x, i=0):
        y = self._aligned((module, "input", i), x, self.q.input(module, x, i))
        if (module, i) in self.q.inputs:
            self.seen[module, "input", i] = (x, y)
        return y

    def output(self, module, y):
        z = self._aligned((module, "output", 0), y, self.q.output(module, y))
        if module in self.q.outputs:
            self.seen[module, "output", 0] = (y, z)
        return z

    def at(self, node):   # a device graph's sub-op points: AIMET-torch's module placement has none to record
        return self.q.at(node)

    def within(self, prefix):
        return self.q.within(prefix)

    def _aligned(self, key, x, y):
        if key not in self.align:
            return y
        x_sim, y_sim = (to_refimpl(key[0], a, y.shape) for a in self.align[key])
        enc = self.encoding(key)
        gap = np.abs(x.astype(np.float64) - x_sim) / np.broadcast_to(enc.scale, x.shape)
        straddle = (np.abs(enc.codes(y).astype(np.int64) - enc.codes(y_sim)) == 1) & (gap < 0.01)
        self.aligned += int(straddle.sum())
        return np.where(straddle, y_sim, y).astype(y.dtype)

    def encoding(self, key):
        return self.q.inputs[key[0], key[2]] if key[1] == "input" else self.q.outputs[key[0]]


def to_refimpl(module: str, a: np.ndarray, shape) -> np.ndarray | None:
    """A QuantSim tensor of `module` in refimpl's tap layout: conv1d's channels-first output (with Kc - 1
    trailing positions from its right padding) sliced and transposed; others reshaped. None if it cannot be."""
    if module.endswith("conv1d") and a.ndim == 3:
        a = a[:, :, :shape[1]].transpose(0, 2, 1)
    return a.reshape(shape) if a.size == math.prod(shape) else None


def measure(arch: str, mix: str, directory, calibration: int = 4, eval_shape=(4, 48), seed: int = 1) -> dict:
    """Build the tiny model, QuantSim it (post_training_tf, default config) at `mix`, calibrate on `calibration`
    random sequences, save the legacy encodings, and compare refimpl with them against sim.model.
    Returns the numbers the acceptance is judged by (see test_aimet.py)."""
    import refimpl
    from refimpl.precision import Policy
    start = time.perf_counter()
    model, sim, encodings, rng = calibrated(arch, mix, directory, seed, calibration)
    seconds = time.perf_counter() - start
    ids = rng.integers(0, BASE["vocab_size"], eval_shape)
    with torch.no_grad():
        float_logits = model(torch.as_tensor(ids)).numpy()
    routed = _router_choices(sim)
    sim_logits, pairs, received = quantiser_values(sim, ids)
    chosen = {name: f() for name, f in routed.items()}
    ref = refimpl.load(str(directory / "hf"), precision=Policy(weights="encodings", encodings=encodings))
    ref.quantisers = rec = Recording(ref.quantisers)
    with refimpl.trace() as tr:
        free_logits = ref.forward(ids)
    free, shapes = dict(rec.seen), {n: v.shape for n, v in tr.records}
    out = {"arch": arch, "mix": mix, "quantisers_quantsim": sorted(pairs), "quantisers_refimpl": sorted(free),
           "weights_differing": _weights_differing(sim, ref), "seconds_quantsim": seconds,
           "unplaced": list(rec.q.unplaced), "max_float_vs_quantsim": _max_abs(float_logits, sim_logits),
           "max_refimpl_vs_quantsim": _max_abs(free_logits, sim_logits),
           "max_abs_quantsim": float(np.abs(sim_logits).max())}

    # MoE: quantised router logits tie often (8-bit: a few hundred levels), and an exact tie at the k-th place is
    # broken by torch.topk's partition order in QuantSim but towards the lower expert id in refimpl (ONNX TopK)
    ties, overrides = 0, {}
    for name, (logits, experts, weights) in chosen.items():
        p = name[:-len(".gate")]
        mine = tr[f"{p}.selected_experts"].reshape(experts.shape)
        k = experts.shape[-1]
        ordered = np.sort(logits, -1)[:, ::-1]
        tied = ordered[:, k - 1] == ordered[:, k]                       # QuantSim's own logits tie at the k-th place
        differ = (np.sort(mine, -1) != np.sort(experts, -1)).any(-1)
        out.setdefault("router_choices_differing", 0)
        out["router_choices_differing"] += int(differ.sum())
        out.setdefault("first_router_untied_differences", int((differ & ~tied).sum()))  # layer 0: only ties
        ties += int((differ & tied).sum())
        overrides[f"{p}.selected_experts"] = experts.reshape(tr[f"{p}.selected_experts"].shape)
        overrides[f"{p}.routing_weights"] = weights.reshape(tr[f"{p}.routing_weights"].shape)
    out["router_ties"] = ties
    if chosen:
        rec.seen.clear()
        with refimpl.trace(overrides=overrides):
            out["max_refimpl_vs_quantsim_routed_as_quantsim"] = _max_abs(ref.forward(ids), sim_logits)
        free = dict(rec.seen)
    # free running again, one-step codes at a rounding boundary taken from QuantSim (Recording.align)
    aligning = Recording(rec.q, pairs)
    ref.quantisers = aligning
    with refimpl.trace(overrides=overrides):
        out["max_refimpl_vs_quantsim_aligned"] = _max_abs(ref.forward(ids), sim_logits)
    out["aligned_codes"], ref.quantisers = aligning.aligned, rec

    # the quantiser arithmetic itself, on QuantSim's own inputs
    out["arithmetic_differences"] = sum(int((rec.encoding(k).apply(x) != y).sum()) for k, (x, y) in pairs.items()
                                        if k in free)
    # teacher forcing: every quantised module's inputs and outputs set to QuantSim's values
    forcing = dict(overrides)
    for (module, i), v in received.items():
        taps = ref.modules.get(module, ())
        if i < len(taps) and taps[i] in shapes and (a := to_refimpl(module, v, shapes[taps[i]])) is not None:
            forcing[taps[i]] = a
    for (module, io, _), (_, v) in pairs.items():
        if io == "output" and module in shapes and (a := to_refimpl(module, v, shapes[module])) is not None:
            forcing[module] = a
    rec.seen.clear()
    with refimpl.trace(overrides=forcing):
        ref.forward(ids)
    forced = dict(rec.seen)
    out["codes"] = {}
    for key, (x_sim, y_sim) in pairs.items():
        if key not in free:
            continue
        enc = rec.encoding(key)
        row = {"elements": int(y_sim.size)}
        for mode, seen in (("free", free), ("forced", forced)):
            x_ref, y_ref = seen[key]
            want = enc.codes(to_refimpl(key[0], y_sim, y_ref.shape))
            got = enc.codes(y_ref)
            step = int(np.abs(want.astype(np.int64) - got).max())
            row[mode] = {"identical": float((want == got).mean()), "max_step": step}
            if mode == "forced" and step:
                flips = want != got   # how far apart the float32 values before the quantiser were, in code steps
                x_s = to_refimpl(key[0], x_sim, x_ref.shape)
                row[mode]["max_float_gap_steps"] = float(np.max(np.abs(x_ref[flips].astype(np.float64) - x_s[flips])
                                                                / np.broadcast_to(enc.scale, x_ref.shape)[flips]))
        out["codes"][" ".join(map(str, key))] = row
    return out


def _router_choices(sim) -> dict:
    """name -> a function returning (its quantised logits, the experts, their weights) each MoE router of sim.model
    computed on its last call."""
    found = {}
    for name, module in sim.model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            box = {}
            module.register_forward_hook(lambda m, a, out, box=box: box.update(out=out))
            found[name] = lambda box=box: tuple(box["out"][i].detach().as_subclass(torch.Tensor).numpy()
                                                for i in (0, 2, 1))
    return found


def _weights_differing(sim, ref) -> int:
    """Elements of QuantSim's quantise-dequantised parameters that differ from refimpl's weights (the encodings
    applied to the same checkpoint)."""
    n = 0
    for name, module in sim.model.named_modules():
        if not isinstance(module, _aimet().BaseQuantizationMixin):
            continue
        for param, q in module.param_quantizers.items():
            if q is None:
                continue
            with torch.no_grad():
                theirs = q(getattr(module, param)).as_subclass(torch.Tensor).numpy()
            n += int((ref.weights[f"{name}.{param}"] != theirs.reshape(ref.weights[f"{name}.{param}"].shape)).sum())
    return n


def _max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def quantsim_dump(sim, ids, bundle, directory, codes=(), fault=None):
    """QuantSim as the quantised device: its module outputs on `ids` written as a dump of `bundle` (a refimpl
    golden of the same prompt, hf convention, with taps): steps/0/taps/<module>.raw float32 and
    steps/0/outputs/logits.raw; taps named in `codes` as their integer codes (the bundle's encodings) instead.
    fault: (module name, f(array) -> array) planted on that module's output inside the run, so everything after it
    computes on the faulty value."""
    from refimpl.diff.quantised import tap_encodings
    hook = None
    if fault is not None:
        module = sim.model.get_submodule(fault[0])
        hook = module.register_forward_hook(lambda m, a, out: torch.as_tensor(fault[1](plain(out))))
    try:
        logits, pairs, _ = quantiser_values(sim, ids)
    finally:
        if hook is not None:
            hook.remove()
    encodings = tap_encodings(bundle)
    out = directory / "steps" / "0"
    (out / "taps").mkdir(parents=True)
    (out / "outputs").mkdir()
    for (module, io, _), (_, value) in pairs.items():
        rec = bundle.manifest["tensors"].get(f"0/tap/{module}")
        if io != "output" or rec is None:
            continue
        a = to_refimpl(module, value, rec["shape"]).astype(np.float32)
        if fault is not None and module == fault[0]:   # the quantiser ran before the hook: the dump has the fault
            a = fault[1](a)
        if module in codes:
            a = encodings[module].codes(a).astype(encodings[module].code_dtype)
        a.tofile(out / "taps" / f"{module}.raw")
    logits.astype(np.float32).tofile(out / "outputs" / "logits.raw")


def plain(t) -> np.ndarray:
    return t.detach().as_subclass(torch.Tensor).numpy().copy()


def three_way_case(arch: str, mix: str, directory, fault=None, prompt_length: int = 24, seed: int = 1) -> dict:
    """The three-way setting with QuantSim as the quantised device: a float golden and a quantised golden of the
    same prompt (hf convention, every tap, the quantised one with its integer codes), and QuantSim's dump of it
    (every other quantised tap as integer codes), with `fault` = (module, f) planted in its run."""
    import refimpl
    from refimpl.bundle import read_bundle
    from refimpl.diff.quantised import tap_encodings
    from refimpl.golden import write_golden
    from refimpl.precision import Policy
    _, sim, encodings, rng = calibrated(arch, mix, directory, seed)
    prompt = rng.integers(0, BASE["vocab_size"], prompt_length)
    source = str(directory / "hf")
    write_golden(directory / "float", refimpl.load(source), prompt, source=source, taps=".")
    quantised_model = refimpl.load(source, precision=Policy(weights="encodings", encodings=encodings))
    write_golden(directory / "quantised", quantised_model, prompt, source=source, taps=".", codes=True)
    quantised = read_bundle(directory / "quantised")
    as_codes = [n for i, n in enumerate(tap_encodings(quantised)) if i % 2]
    quantsim_dump(sim, prompt[None], quantised, directory / "device", codes=as_codes, fault=fault)
    return {"float": directory / "float", "quantised": directory / "quantised", "device": directory / "device",
            "encodings": encodings}
