"""Checkpoint loading: dtypes, sharding, expert layouts, lazy memory maps, and clear errors on bad input."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

import refimpl
from refimpl.errors import ConfigError, FormatError, WeightsError
from refimpl.formats.safetensors import read_safetensors, write_safetensors
from refimpl.presets import save_preset


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_preset("tiny-qwen3-moe", tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return save_preset("tiny-qwen3", tmp_path_factory.mktemp("dense"))


IDS = np.array([[5, 17, 123, 9999, 151000]])


def _copy(src, dst, edit=None, config_edit=None):
    shutil.copytree(src, dst)
    if edit is not None:
        arrays = {k: np.array(v) for k, v in read_safetensors(dst / "model.safetensors").items()}
        edit(arrays)
        write_safetensors(dst / "model.safetensors", arrays)
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_loaded_directory_equals_the_preset(dense_dir):
    np.testing.assert_array_equal(refimpl.load(dense_dir).forward(IDS), refimpl.load("tiny-qwen3").forward(IDS))


def test_float32_checkpoint_is_used_in_place_without_copies(dense_dir):
    model = refimpl.load(dense_dir)
    w = model.weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(w.base, np.memmap) or isinstance(w, np.memmap) or not w.flags.owndata


def test_fused_experts_equal_per_expert(moe_dir, tmp_path):
    def fuse(arrays):
        for i in range(4):
            p = f"model.layers.{i}.mlp.experts"
            gate = [arrays.pop(f"{p}.{e}.gate_proj.weight") for e in range(8)]
            up = [arrays.pop(f"{p}.{e}.up_proj.weight") for e in range(8)]
            down = [arrays.pop(f"{p}.{e}.down_proj.weight") for e in range(8)]
            arrays[f"{p}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
            arrays[f"{p}.down_proj"] = np.stack(down)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in read_safetensors(moe_dir / "model.safetensors")
    fused = _copy(moe_dir, tmp_path / "fused", edit=fuse)
    np.testing.assert_array_equal(refimpl.load(fused).forward(IDS), refimpl.load(moe_dir).forward(IDS))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_checkpoints_upcast_exactly(dense_dir, tmp_path, dtype):
    def cast(arrays):
        for k in arrays:
            arrays[k] = arrays[k].astype(dtype)
    half = _copy(dense_dir, tmp_path / "half", edit=cast)
    rounded = _copy(dense_dir, tmp_path / "rounded",
                    edit=lambda a: a.update({k: v.astype(dtype).astype(np.float32) for k, v in a.items()}))
    assert read_safetensors(half / "model.safetensors")["model.norm.weight"].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(refimpl.load(half).forward(IDS), refimpl.load(rounded).forward(IDS))


def test_sharded_checkpoint_equals_single_file(dense_dir, tmp_path):
    arrays = read_safetensors(dense_dir / "model.safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(dense_dir / "config.json", sharded)
    names = sorted(arrays)
    weight_map = {}
    for s, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{s + 1}-of-00002.safetensors"
        write_safetensors(sharded / fname, {n: np.array(arrays[n]) for n in part})
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    np.testing.assert_array_equal(refimpl.load(sharded).forward(IDS), refimpl.load(dense_dir).forward(IDS))


def test_multimodal_prefix_and_mtp_tensors(dense_dir, tmp_path):
    def wrap(arrays):
        for k in list(arrays):
            if k.startswith("model."):
                arrays["model.language_model." + k[len("model."):]] = arrays.pop(k)
        arrays["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    wrapped = _copy(dense_dir, tmp_path / "wrapped", edit=wrap)
    model = refimpl.load(wrapped)
    assert model.weights.set_aside == ["mtp.fc.weight"]
    np.testing.assert_array_equal(model.forward(IDS), refimpl.load(dense_dir).forward(IDS))


# ---- bad input: each error names the file and the tensor or field, with expected vs actual ----

def test_config_missing_field(dense_dir, tmp_path):
    bad = _copy(dense_dir, tmp_path / "bad", config_edit=lambda c: c.pop("hidden_size"))
    with pytest.raises(ConfigError, match=r"config\.json: missing field 'hidden_size'"):
        refimpl.load(bad)


def test_config_unknown_model_type(dense_dir, tmp_path):
    bad = _copy(dense_dir, tmp_path / "bad", config_edit=lambda c: c.update(model_type="llama"))
    with pytest.raises(ConfigError, match=r"config\.json: unknown model_type 'llama'"):
        refimpl.load(bad)


def test_config_not_json(dense_dir, tmp_path):
    bad = _copy(dense_dir, tmp_path / "bad")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        refimpl.load(bad)


def test_config_inconsistent_layer_types(dense_dir, tmp_path):
    bad = _copy(dense_dir, tmp_path / "bad", config_edit=lambda c: c.update(layer_types=["full_attention"] * 3))
    with pytest.raises(ConfigError, match="layer_types has 3 entries, num_hidden_layers is 4"):
        refimpl.load(bad)


def test_missing_tensor(dense_dir, tmp_path):
    bad = _copy(dense_dir, tmp_path / "bad", edit=lambda a: a.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"bad: missing tensor 'model.layers.2.mlp.up_proj.weight' "
                                           r"\(expected shape \[192, 64\]\)"):
        refimpl.load(bad)


def test_missing_per_expert_tensor(moe_dir, tmp_path):
    bad = _copy(moe_dir, tmp_path / "bad", edit=lambda a: a.pop("model.layers.1.mlp.experts.5.down_proj.weight"))
    with pytest.raises(WeightsError, match=r"missing tensor 'model.layers.1.mlp.experts.5.down_proj.weight'"):
        refimpl.load(bad)


def test_wrong_shape(dense_dir, tmp_path):
    bad = _copy(dense_dir, tmp_path / "bad",
                edit=lambda a: a.update({"model.layers.0.self_attn.k_norm.weight": np.ones(16, np.float32)}))
    with pytest.raises(WeightsError, match=r"tensor 'model.layers.0.self_attn.k_norm.weight' has shape \[16\], "
                                           r"expected \[32\]"):
        refimpl.load(bad)


def test_wrong_dtype(dense_dir, tmp_path):
    bad = _copy(dense_dir, tmp_path / "bad", edit=lambda a: a.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(WeightsError, match=r"tensor 'model.norm.weight' has dtype int32, expected a float type"):
        refimpl.load(bad)


@pytest.mark.parametrize("keep", [4, 100, -1000])
def test_truncated_safetensors(dense_dir, tmp_path, keep):
    bad = _copy(dense_dir, tmp_path / "bad")
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(FormatError, match=r"model\.safetensors: (truncated|corrupt)"):
        refimpl.load(bad)


def test_truncated_names_the_tensor(dense_dir, tmp_path):
    bad = _copy(dense_dir, tmp_path / "bad")
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(FormatError, match=r"truncated: tensor '[^']+' needs bytes"):
        read_safetensors(f)


def test_unknown_source():
    with pytest.raises(refimpl.errors.InputError, match="not a preset"):
        refimpl.load("no-such-model")


# ---- config edge cases, as transformers reads them (found by review; each was a silent mismatch) ----

from refimpl.models.config import config_from_dict  # noqa: E402

_Q3 = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
       "intermediate_size": 4}


def test_rope_scaling_wins_over_rope_parameters():
    cfg = config_from_dict({**_Q3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                            "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert cfg.rope["rope_type"] == "yarn" and cfg.rope["rope_theta"] == 10000.0


def test_top_level_original_max_position_embeddings_wins():
    cfg = config_from_dict({**_Q3, "original_max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 1024}})
    assert cfg.rope["original_max_position_embeddings"] == 64


def test_sliding_window_null_means_no_window():
    cfg = config_from_dict({**_Q3, "use_sliding_window": True, "sliding_window": None, "max_window_layers": 0})
    assert cfg.sliding_window is None and set(cfg.layer_types) == {"full_attention"}


def test_qwen3_moe_ignores_layer_types():
    cfg = config_from_dict({**_Q3, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 4, "use_sliding_window": True, "sliding_window": 8,
                            "layer_types": ["full_attention", "full_attention"]})
    assert cfg.layer_types == ("sliding_attention", "sliding_attention")


def test_legacy_layer_type_names():
    cfg = config_from_dict({**_Q3, "model_type": "qwen3_next", "num_experts": 4, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 4, "shared_expert_intermediate_size": 4,
                            "layer_types": ["mamba", "attention"]})
    assert cfg.layer_types == ("linear_attention", "full_attention")


def test_multimodal_wrapper_ties_by_its_own_flag():
    text = {**_Q3, "model_type": "qwen3_5_text", "tie_word_embeddings": True}
    assert not config_from_dict({"model_type": "qwen3_5", "text_config": text}).tie_word_embeddings
    assert config_from_dict({"model_type": "qwen3_5", "tie_word_embeddings": True,
                             "text_config": {**text, "tie_word_embeddings": False}}).tie_word_embeddings


@pytest.mark.parametrize("edit,message", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": None}, "rope_theta": None}, "rope_theta must be"),
    ({"rope_parameters": {"rope_type": "ntk-by-parts"}}, "unknown rope_type"),
    ({"rope_parameters": {"rope_type": "linear"}}, "needs 'factor'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "needs 'low_freq_factor'"),
    ({"hidden_act": "swiglu-ish"}, "unsupported hidden_act"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps must be"),
])
def test_bad_config_values_fail_at_load(edit, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**_Q3, **edit})


def test_attention_bias_false_ignores_stored_biases(dense_dir, tmp_path):
    """transformers builds no bias parameters when attention_bias is false; stray bias tensors are dropped."""
    extra = _copy(dense_dir, tmp_path / "extra", edit=lambda a: a.update(
        {"model.layers.0.self_attn.q_proj.bias": np.ones(128, np.float32)}))
    np.testing.assert_array_equal(refimpl.load(extra).forward(IDS), refimpl.load(dense_dir).forward(IDS))
