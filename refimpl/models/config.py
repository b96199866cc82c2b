"""ModelConfig: every field the forward pass reads, from an HF config.json (or GGUF metadata).

Defaults are transformers 5.23's class defaults; structural fields (sizes, counts) are required, because a
config.json that lacks them is broken and a silent default would build the wrong model.
"""

import dataclasses
from pathlib import Path

from ..errors import ConfigError, brief
from ..files import expect, integer, load_json, number
from ..kernels.activation import ACTIVATIONS
from ..kernels.rope import interleaved_mrope_axes

SUPPORTED = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# what tells them apart, declared once (ModelConfig's properties, config_from_dict and the GGUF reader read these)
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")   # Gated DeltaNet layers beside gated attention
MOE_TYPES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text")          # routed experts
SHARED_EXPERT_TYPES = ("qwen3_next", "qwen3_5_moe_text")             # ... and a gated shared expert beside them
MOE_ONLY_TYPES = ("qwen3_5_moe_text",)         # every layer MoE: no mlp_only_layers, no decoder_sparse_step
MROPE_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")                   # interleaved M-RoPE (mrope_section)
MULTIMODAL_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

# transformers 5.23 class defaults of the fields that may be absent from a config.json
_DEFAULTS = {
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    "decoder_sparse_step": 1, "mlp_only_layers": None, "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
}
_DEFAULT_HEAD_DIM = {"qwen3": 128, "qwen3_next": 256, "qwen3_5_text": 256, "qwen3_5_moe_text": 256}
_DEFAULT_NORM_TOPK = {"qwen3_moe": False, "qwen3_next": True, "qwen3_5_moe_text": True}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_LAYER_TYPES = {"full_attention", "sliding_attention", "linear_attention"}
# Upper bounds far beyond any real model (Qwen3: 94 layers, 512 experts, vocab 248k): loops run over layers and
# experts, so a damaged config.json (or manifest, or GGUF) must not make them run for hours.
MAX_SIZE = 2**31 - 1          # any size or count (ONNX / QNN shapes are int32 here)
MAX_LAYERS = 4096
MAX_EXPERTS = 65536


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int | None
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope: dict                      # standardised rope_parameters: rope_type, rope_theta, factor, ...
    rotary_dim: int                 # rotated channels per head (rot)
    layer_types: tuple              # per layer: full_attention | sliding_attention | linear_attention
    sliding_window: int | None
    # mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    # gated deltanet (hybrid models)
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    mrope_section: tuple | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None
    source: str = ""
    mtp_layers: int = 0             # multi-token-prediction blocks in the checkpoint (recognised, not run)
    # whose meaning the config has where transformers and llama.cpp compute a model differently: "transformers"
    # (HF checkpoints, presets) or "llama.cpp" (GGUF files: a GGUF means what llama.cpp runs). The properties below
    # and rotary_dim carry each difference; semantic_differences() lists those that matter for this config.
    semantics: str = "transformers"

    @property
    def is_hybrid(self) -> bool:
        return self.model_type in HYBRID_TYPES

    @property
    def fused_linear_projections(self) -> bool:
        """Qwen3-Next's Gated DeltaNet projections are fused and grouped per key head (in_proj_qkvz, in_proj_ba);
        Qwen3.5's are split (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), its value heads in their own order."""
        return self.model_type == "qwen3_next"

    @property
    def fused_expert_checkpoint(self) -> bool:
        """Qwen3.5-MoE checkpoints store the routed experts fused (experts.gate_up_proj [E, 2Ie, H],
        experts.down_proj [E, H, Ie]); Qwen3-MoE and Qwen3-Next store them per expert (experts.{e}.gate_proj...)."""
        return self.model_type == "qwen3_5_moe_text"

    @property
    def conv_dim(self) -> int:
        """Channels of the Gated DeltaNet conv: [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def zero_centered_norms(self) -> bool:
        """Qwen3-Next / Qwen3.5 scale their norms by (1 + w); Qwen3 / Qwen3-MoE by w."""
        return self.is_hybrid

    @property
    def mrope_pair_axes(self) -> tuple | None:
        """Per rotary pair, the position axis it rotates with under Qwen3.5's interleaved M-RoPE (0 T, 1 H, 2 W,
        3 llama.cpp's fourth axis, position 0 for text), by transformers' rule or llama.cpp's
        (kernels.rope.interleaved_mrope_axes: they differ only where mrope_section leaves pairs uncovered)."""
        if self.mrope_section is None:
            return None
        return tuple(int(a) for a in interleaved_mrope_axes(self.rotary_dim // 2, self.mrope_section,
                                                            llama_cpp=self.semantics == "llama.cpp"))

    @property
    def linear_l2norm_eps(self) -> float:
        """eps of the Gated DeltaNet q / k l2norm, x / sqrt(sum x^2 + eps): transformers fixes it at 1e-6;
        llama.cpp (build_gdn_l2_norm) uses rms_norm_eps."""
        return self.rms_norm_eps if self.semantics == "llama.cpp" else 1e-6

    def semantic_differences(self) -> list[str]:
        """Where this config, under llama.cpp's semantics, computes something other than transformers would for
        the same fields (empty under transformers' semantics, and for files whose values make the two agree)."""
        if self.semantics != "llama.cpp":
            return []
        out = []
        if self.mrope_section is not None:
            still = [j for j, a in enumerate(self.mrope_pair_axes) if a == 3]
            if still:
                out.append(f"rotary pairs {still} of {self.rotary_dim // 2} stay unrotated for text (mrope_section "
                           f"{list(self.mrope_section)} leaves them to llama.cpp's fourth section, position 0; "
                           f"transformers rotates them by the text position)")
        if self.is_hybrid and self.linear_l2norm_eps != 1e-6:
            out.append(f"Gated DeltaNet q/k l2norm eps {self.linear_l2norm_eps:g} (rms_norm_eps; transformers: 1e-6)")
        return out

    def is_moe_layer(self, i: int) -> bool:
        if self.model_type in MOE_ONLY_TYPES:
            return True
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


_ROPE_KEYS = {"default": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "longrope": ("short_factor", "long_factor")}


def _standardize_rope(d: dict, hybrid: bool, source: str) -> dict:
    """transformers 5.x `rope_parameters`, as its config standardisation builds them: a `rope_scaling` dict wins
    over `rope_parameters` (the Qwen YaRN recipe adds one to a v5 config), rope_theta from that dict, else the
    top-level field, else 10000; a top-level original_max_position_embeddings overrides the dict's."""
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: rope_parameters / rope_scaling must be an object, got {brief(rope)}")
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = d.get("rope_theta", 10000.0)
    prf = d.get("partial_rotary_factor", 0.25 if hybrid else None)
    if prf is not None:
        rope.setdefault("partial_rotary_factor", prf)
    kind = rope["rope_type"]
    if kind in ("llama3", "yarn", "longrope"):
        if d.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 32768))
    if not isinstance(kind, str) or kind not in _ROPE_KEYS:
        raise ConfigError(f"{source}: unknown rope_type {brief(kind)}; supported: {', '.join(_ROPE_KEYS)}")
    theta = rope["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 1 < theta < float("inf"):
        raise ConfigError(f"{source}: rope_theta must be a finite number > 1, got {brief(theta)}")
    for key in _ROPE_KEYS[kind]:
        if rope.get(key) is None:
            raise ConfigError(f"{source}: rope_type {brief(kind)} needs {key!r} in rope_parameters")
    _check_rope_values(rope, source)
    return rope


# rope_parameters fields the kernels read: a positive number, a number, a positive size, a bool, a list
_POSITIVE = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")
_NUMBERS = ("low_freq_factor", "high_freq_factor")


def _check_rope_values(rope: dict, source: str) -> None:
    where = f"{source}: rope_parameters"
    for key in _POSITIVE + _NUMBERS:
        if rope.get(key) is not None:
            v = number(rope[key], f"{where}.{key}", ConfigError)
            if key in _POSITIVE and not v > 0:
                raise ConfigError(f"{where}.{key} must be positive, got {brief(v)}")
    if rope.get("original_max_position_embeddings") is not None:
        integer(rope["original_max_position_embeddings"], f"{where}.original_max_position_embeddings", ConfigError,
                lo=1, hi=MAX_SIZE)
    prf = rope.get("partial_rotary_factor")
    if "partial_rotary_factor" in rope and not 0 < number(prf, f"{where}.partial_rotary_factor", ConfigError) <= 1:
        raise ConfigError(f"{where}.partial_rotary_factor must be in (0, 1], got {brief(prf)}")
    for key in ("short_factor", "long_factor"):
        if rope.get(key) is not None:
            for v in expect(rope[key], list, f"{where}.{key}", ConfigError):
                number(v, f"{where}.{key}", ConfigError)
    if rope.get("mrope_section") is not None:
        for v in expect(rope["mrope_section"], list, f"{where}.mrope_section", ConfigError):
            integer(v, f"{where}.mrope_section", ConfigError, lo=0, hi=MAX_SIZE)


def config_from_dict(d: dict, source: str = "config.json", semantics: str = "transformers") -> ModelConfig:
    """Build and check a ModelConfig from a config.json dict (multimodal wrappers: their text_config).
    semantics: "transformers" (an HF config) or "llama.cpp" (the dict a GGUF's metadata describes)."""
    if semantics not in ("transformers", "llama.cpp"):
        raise ConfigError(f"{source}: semantics must be 'transformers' or 'llama.cpp', got {brief(semantics)}")
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    model_type = d.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{source}: model_type {brief(model_type)} is not a string; supported: "
                          f"{', '.join(SUPPORTED)}")
    if model_type in MULTIMODAL_WRAPPERS:
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type {brief(model_type)} needs a 'text_config' object")
        text = {**text, "model_type": text.get("model_type", MULTIMODAL_WRAPPERS[model_type])}
        # the wrapper (the checkpoint's declared architecture) ties by its own flag, not text_config's
        text["tie_word_embeddings"] = d.get("tie_word_embeddings", False)
        d = text
        model_type = d["model_type"]
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        raise ConfigError(f"{source}: unknown model_type {brief(model_type)}; supported: {', '.join(SUPPORTED)}")
    hybrid = model_type in HYBRID_TYPES

    def get(key, required=False, default=None):
        if key in d and d[key] is not None:
            return d[key]
        if required:
            raise ConfigError(f"{source}: missing field {key!r} (needed for model_type {model_type!r})")
        return _DEFAULTS.get(key, default)

    def positive_int(key, value, hi=MAX_SIZE):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{source}: field {key!r} must be a positive integer, got {brief(value)}")
        if value > hi:
            raise ConfigError(f"{source}: field {key!r} is {value}, beyond the {hi} refimpl accepts (a corrupt "
                              f"config?)")
        return value

    def flag(key):
        value = get(key)
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: field {key!r} must be true or false, got {brief(value)}")
        return value

    def token_ids(key, many=False):
        value = d.get(key)
        values = value if many and isinstance(value, list) else [value]
        if value is not None and not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise ConfigError(f"{source}: field {key!r} must be a token id{' or a list of them' if many else ''}, "
                              f"got {brief(value)}")
        return value

    req = {k: positive_int(k, get(k, required=True), MAX_LAYERS if k == "num_hidden_layers" else MAX_SIZE)
           for k in _REQUIRED}
    L, heads = req["num_hidden_layers"], req["num_attention_heads"]
    kv_heads = positive_int("num_key_value_heads", get("num_key_value_heads", default=heads))
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = d.get("head_dim") or _DEFAULT_HEAD_DIM.get(model_type) or req["hidden_size"] // heads
    positive_int("head_dim", head_dim)

    moe = model_type in MOE_TYPES
    if "num_experts" not in d and "num_local_experts" in d:  # transformers 5 saves the alias
        d = {**d, "num_experts": d["num_local_experts"]}
    num_experts = get("num_experts", required=moe) if moe else 0
    if moe:
        positive_int("num_experts", num_experts, MAX_EXPERTS)
    mlp_only = get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < L
                                                  for i in mlp_only):
        raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices in [0, {L}), got "
                          f"{brief(mlp_only)}")
    mlp_only = tuple(mlp_only)
    sparse_step = get("decoder_sparse_step")
    needs_dense = not moe or model_type not in MOE_ONLY_TYPES and (mlp_only or sparse_step != 1)
    intermediate = get("intermediate_size", required=needs_dense)
    if intermediate is not None:
        positive_int("intermediate_size", intermediate)

    rope = _standardize_rope(d, hybrid, source)
    if hybrid:
        rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    else:
        rotary_dim = head_dim  # Qwen3's rotary embedding always spans the full head (llama.cpp asserts it too)
    if rotary_dim % 2 or rotary_dim <= 0:
        raise ConfigError(f"{source}: rotary dim {rotary_dim} (head_dim {head_dim} x partial_rotary_factor) must be "
                          f"even")

    # null stays null: transformers then has no window at all
    sliding_window = d.get("sliding_window", _DEFAULTS["sliding_window"]) if flag("use_sliding_window") else None
    if sliding_window is not None:
        positive_int("sliding_window", sliding_window)
    # transformers' Qwen3-MoE has no layer_types: the window, when set, applies to every layer
    layer_types = None if model_type == "qwen3_moe" else d.get("layer_types")
    if layer_types is not None:  # transformers' legacy names
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise ConfigError(f"{source}: layer_types must be a list of layer type names, got {brief(layer_types)}")
        layer_types = [{"attention": "full_attention", "mamba": "linear_attention"}.get(t, t) for t in layer_types]
    if layer_types is None:
        if hybrid:
            interval = positive_int("full_attention_interval", get("full_attention_interval"))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
        elif model_type == "qwen3":
            window_layers = get("max_window_layers")
            if not isinstance(window_layers, int) or isinstance(window_layers, bool):
                raise ConfigError(f"{source}: field 'max_window_layers' must be an integer, got {brief(window_layers)}")
            layer_types = ["sliding_attention" if sliding_window is not None and i >= window_layers
                           else "full_attention" for i in range(L)]
        else:  # qwen3_moe applies the window, when enabled, to every layer
            layer_types = ["sliding_attention" if sliding_window is not None else "full_attention"] * L
    if len(layer_types) != L:
        raise ConfigError(f"{source}: layer_types has {len(layer_types)} entries, num_hidden_layers is {L}")
    bad = sorted(set(layer_types) - _LAYER_TYPES)
    if bad:
        raise ConfigError(f"{source}: unknown layer type {brief(bad[0])} in layer_types")
    if "sliding_attention" in layer_types and sliding_window is None:
        raise ConfigError(f"{source}: layer_types has sliding_attention layers but sliding_window is not set")
    if not hybrid and "linear_attention" in layer_types:
        raise ConfigError(f"{source}: model_type {model_type!r} has no linear_attention layers")

    if not isinstance(get("hidden_act"), str) or get("hidden_act") not in ACTIVATIONS:
        raise ConfigError(f"{source}: unsupported hidden_act {brief(get('hidden_act'))}; supported: "
                          f"{', '.join(ACTIVATIONS)}")
    positive_int("max_position_embeddings", get("max_position_embeddings"))
    eps = get("rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
        raise ConfigError(f"{source}: rms_norm_eps must be a small non-negative number, got {brief(eps)}")

    def flag_or(key, default):
        value = get(key, default=default)
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: field {key!r} must be true or false, got {brief(value)}")
        return value

    extra = {}
    if moe:
        extra.update(
            num_experts=num_experts,
            num_experts_per_tok=positive_int("num_experts_per_tok", get("num_experts_per_tok", required=True),
                                             MAX_EXPERTS),
            moe_intermediate_size=positive_int("moe_intermediate_size", get("moe_intermediate_size", required=True)),
            norm_topk_prob=True if model_type == "qwen3_5_moe_text" else flag_or(
                "norm_topk_prob", _DEFAULT_NORM_TOPK[model_type]),
            decoder_sparse_step=positive_int("decoder_sparse_step", sparse_step),
            mlp_only_layers=mlp_only,
        )
        if extra["num_experts_per_tok"] > num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok {extra['num_experts_per_tok']} > num_experts "
                              f"{num_experts}")
        if model_type in SHARED_EXPERT_TYPES:
            extra["shared_expert_intermediate_size"] = positive_int(
                "shared_expert_intermediate_size", get("shared_expert_intermediate_size", required=True))
    if hybrid:
        lin = {k: positive_int(k, get(k)) for k in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                     "linear_value_head_dim", "linear_num_key_heads",
                                                     "linear_num_value_heads")}
        if lin["linear_num_value_heads"] % lin["linear_num_key_heads"]:
            raise ConfigError(f"{source}: linear_num_value_heads {lin['linear_num_value_heads']} is not a multiple "
                              f"of linear_num_key_heads {lin['linear_num_key_heads']}")
        extra.update(lin)
        if model_type in MROPE_TYPES:
            extra["mrope_section"] = tuple(rope.get("mrope_section") or (11, 11, 10))
            if len(extra["mrope_section"]) not in (3, 4):
                raise ConfigError(f"{source}: mrope_section must have 3 entries (T, H, W; a GGUF's fourth is "
                                  f"llama.cpp's extra axis), got {brief(list(extra['mrope_section']))}")
        mtp = d.get("mtp_num_hidden_layers") or d.get("num_nextn_predict_layers") or 0
        if not isinstance(mtp, int) or isinstance(mtp, bool) or not 0 <= mtp <= MAX_LAYERS:
            raise ConfigError(f"{source}: mtp_num_hidden_layers must be a small integer >= 0, got {brief(mtp)}")
        extra["mtp_layers"] = mtp

    return ModelConfig(
        model_type=model_type, **req, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=intermediate, hidden_act=get("hidden_act"),
        max_position_embeddings=get("max_position_embeddings"), rms_norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=flag("tie_word_embeddings"), attention_bias=flag("attention_bias"),
        rope=rope, rotary_dim=rotary_dim, layer_types=tuple(layer_types), sliding_window=sliding_window,
        bos_token_id=token_ids("bos_token_id"), eos_token_id=token_ids("eos_token_id", many=True),
        pad_token_id=token_ids("pad_token_id"),
        source=source, semantics=semantics, **extra,
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read and check `config.json` (a file, or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    return config_from_dict(load_json(path, "config", ConfigError), source=str(path))


GENERATION_FIELDS = {"eos_token_id": (int, list), "do_sample": (bool,), "temperature": (int, float),
                     "top_k": (int,), "top_p": (int, float), "min_p": (int, float),
                     "repetition_penalty": (int, float)}


def read_generation_config(directory: str | Path) -> dict:
    """The fields of a checkpoint's generation_config.json that generation honours (eos ids, do_sample and the
    sampling settings), type-checked; {} when the file is absent. Other fields are ignored."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    d = load_json(path, "generation config", ConfigError)
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    out = {}
    for key, types in GENERATION_FIELDS.items():
        value = d.get(key)
        if value is None:
            continue
        ok = isinstance(value, types) and (bool not in types) == (not isinstance(value, bool))
        if key == "eos_token_id" and isinstance(value, list):
            ok = all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        if not ok:
            raise ConfigError(f"{path}: field {key!r} has an unexpected value {brief(value)}")
        out[key] = value
    return out
