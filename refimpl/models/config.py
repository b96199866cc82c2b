"""ModelConfig: every field the forward pass reads, from an HF config.json (or GGUF metadata).

Defaults are transformers 5.23's class defaults; structural fields (sizes, counts) are required, because a
config.json that lacks them is broken and a silent default would build the wrong model.
"""

import dataclasses
import json
from pathlib import Path

from ..errors import ConfigError
from ..kernels.activation import ACTIVATIONS
from ..kernels.rope import interleaved_mrope_axes

DENSE_TYPES = ("qwen3",)
MOE_TYPES = ("qwen3_moe",)
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
MULTIMODAL_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
SUPPORTED = DENSE_TYPES + MOE_TYPES + HYBRID_TYPES

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
        if self.model_type == "qwen3_5_moe_text":
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
    rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
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
    if kind not in _ROPE_KEYS:
        raise ConfigError(f"{source}: unknown rope_type {kind!r}; supported: {', '.join(_ROPE_KEYS)}")
    theta = rope["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 1 < theta < float("inf"):
        raise ConfigError(f"{source}: rope_theta must be a finite number > 1, got {theta!r}")
    for key in _ROPE_KEYS[kind]:
        if rope.get(key) is None:
            raise ConfigError(f"{source}: rope_type {kind!r} needs {key!r} in rope_parameters")
    return rope


def config_from_dict(d: dict, source: str = "config.json", semantics: str = "transformers") -> ModelConfig:
    """Build and check a ModelConfig from a config.json dict (multimodal wrappers: their text_config).
    semantics: "transformers" (an HF config) or "llama.cpp" (the dict a GGUF's metadata describes)."""
    if semantics not in ("transformers", "llama.cpp"):
        raise ConfigError(f"{source}: semantics must be 'transformers' or 'llama.cpp', got {semantics!r}")
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type in MULTIMODAL_WRAPPERS:
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type {model_type!r} needs a 'text_config' object")
        text = {**text, "model_type": text.get("model_type", MULTIMODAL_WRAPPERS[model_type])}
        # the wrapper (the checkpoint's declared architecture) ties by its own flag, not text_config's
        text["tie_word_embeddings"] = d.get("tie_word_embeddings", False)
        d = text
        model_type = d["model_type"]
    if model_type not in SUPPORTED:
        raise ConfigError(f"{source}: unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED)}")
    hybrid = model_type in HYBRID_TYPES

    def get(key, required=False, default=None):
        if key in d and d[key] is not None:
            return d[key]
        if required:
            raise ConfigError(f"{source}: missing field {key!r} (needed for model_type {model_type!r})")
        return _DEFAULTS.get(key, default)

    def positive_int(key, value):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
        return value

    req = {k: positive_int(k, get(k, required=True)) for k in _REQUIRED}
    L, heads = req["num_hidden_layers"], req["num_attention_heads"]
    kv_heads = positive_int("num_key_value_heads", get("num_key_value_heads", default=heads))
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = d.get("head_dim") or _DEFAULT_HEAD_DIM.get(model_type) or req["hidden_size"] // heads
    positive_int("head_dim", head_dim)

    moe = model_type in MOE_TYPES or model_type in ("qwen3_next", "qwen3_5_moe_text")
    if "num_experts" not in d and "num_local_experts" in d:  # transformers 5 saves the alias
        d = {**d, "num_experts": d["num_local_experts"]}
    num_experts = get("num_experts", required=moe) if moe else 0
    if moe:
        positive_int("num_experts", num_experts)
    mlp_only = tuple(get("mlp_only_layers") or ())
    sparse_step = get("decoder_sparse_step")
    needs_dense = not moe or model_type != "qwen3_5_moe_text" and (
        mlp_only or sparse_step != 1)
    intermediate = get("intermediate_size", required=needs_dense)

    rope = _standardize_rope(d, hybrid, source)
    if hybrid:
        rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    else:
        rotary_dim = head_dim  # Qwen3's rotary embedding always spans the full head (llama.cpp asserts it too)
    if rotary_dim % 2 or rotary_dim <= 0:
        raise ConfigError(f"{source}: rotary dim {rotary_dim} (head_dim {head_dim} x partial_rotary_factor) must be even")

    # null stays null: transformers then has no window at all
    sliding_window = d.get("sliding_window", _DEFAULTS["sliding_window"]) if get("use_sliding_window") else None
    # transformers' Qwen3-MoE has no layer_types: the window, when set, applies to every layer
    layer_types = None if model_type == "qwen3_moe" else d.get("layer_types")
    if layer_types is not None:  # transformers' legacy names
        layer_types = [{"attention": "full_attention", "mamba": "linear_attention"}.get(t, t) for t in layer_types]
    if layer_types is None:
        if hybrid:
            interval = positive_int("full_attention_interval", get("full_attention_interval"))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
        elif model_type == "qwen3":
            window_layers = get("max_window_layers")
            layer_types = ["sliding_attention" if sliding_window is not None and i >= window_layers
                           else "full_attention" for i in range(L)]
        else:  # qwen3_moe applies the window, when enabled, to every layer
            layer_types = ["sliding_attention" if sliding_window is not None else "full_attention"] * L
    if len(layer_types) != L:
        raise ConfigError(f"{source}: layer_types has {len(layer_types)} entries, num_hidden_layers is {L}")
    bad = sorted(set(layer_types) - _LAYER_TYPES)
    if bad:
        raise ConfigError(f"{source}: unknown layer type {bad[0]!r} in layer_types")
    if "sliding_attention" in layer_types and sliding_window is None:
        raise ConfigError(f"{source}: layer_types has sliding_attention layers but sliding_window is not set")
    if not hybrid and "linear_attention" in layer_types:
        raise ConfigError(f"{source}: model_type {model_type!r} has no linear_attention layers")

    if get("hidden_act") not in ACTIVATIONS:
        raise ConfigError(f"{source}: unsupported hidden_act {get('hidden_act')!r}; supported: {', '.join(ACTIVATIONS)}")
    eps = get("rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
        raise ConfigError(f"{source}: rms_norm_eps must be a small non-negative number, got {eps!r}")

    extra = {}
    if moe:
        extra.update(
            num_experts=num_experts,
            num_experts_per_tok=positive_int("num_experts_per_tok", get("num_experts_per_tok", required=True)),
            moe_intermediate_size=positive_int("moe_intermediate_size", get("moe_intermediate_size", required=True)),
            norm_topk_prob=True if model_type == "qwen3_5_moe_text" else bool(
                get("norm_topk_prob", default=_DEFAULT_NORM_TOPK[model_type])),
            decoder_sparse_step=positive_int("decoder_sparse_step", sparse_step),
            mlp_only_layers=mlp_only,
        )
        if extra["num_experts_per_tok"] > num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok {extra['num_experts_per_tok']} > num_experts {num_experts}")
        if model_type != "qwen3_moe":
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
        if model_type != "qwen3_next":
            extra["mrope_section"] = tuple(rope.get("mrope_section") or (11, 11, 10))
            if len(extra["mrope_section"]) not in (3, 4):
                raise ConfigError(f"{source}: mrope_section must have 3 entries (T, H, W; a GGUF's fourth is "
                                  f"llama.cpp's extra axis), got {list(extra['mrope_section'])}")
        extra["mtp_layers"] = int(d.get("mtp_num_hidden_layers") or d.get("num_nextn_predict_layers") or 0)

    return ModelConfig(
        model_type=model_type, **req, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=intermediate, hidden_act=get("hidden_act"),
        max_position_embeddings=get("max_position_embeddings"), rms_norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(get("tie_word_embeddings")), attention_bias=bool(get("attention_bias")),
        rope=rope, rotary_dim=rotary_dim, layer_types=tuple(layer_types), sliding_window=sliding_window,
        bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"), pad_token_id=d.get("pad_token_id"),
        source=source, semantics=semantics, **extra,
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read and check `config.json` (a file, or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return config_from_dict(d, source=str(path))


GENERATION_FIELDS = {"eos_token_id": (int, list), "do_sample": (bool,), "temperature": (int, float),
                     "top_k": (int,), "top_p": (int, float), "min_p": (int, float),
                     "repetition_penalty": (int, float)}


def read_generation_config(directory: str | Path) -> dict:
    """The fields of a checkpoint's generation_config.json that generation honours (eos ids, do_sample and the
    sampling settings), type-checked; {} when the file is absent. Other fields are ignored."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
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
            raise ConfigError(f"{path}: field {key!r} has an unexpected value {value!r}")
        out[key] = value
    return out
