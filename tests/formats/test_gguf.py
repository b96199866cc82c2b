"""GGUF: files made by llama.cpp's own converter and quantiser (tests/fixtures/gguf, see make_fixtures.py) read back
to the HF arrays; logits against llama.cpp's recorded ones; the writer against the converter; bad files.

The HF checkpoints behind the fixtures are rebuilt from their seed (tests/gguf_cases.py). Exactness: every
tensor comes back bit for bit except two that llama.cpp stores through a float32 function: zero-centred norms
(stored 1 + w, so w = stored - 1 loses what 1 + w rounded away: |dw| <= 2^-24, and 1 + w itself is identical)
and A_log (stored -exp(A_log); ln of it is within 2^-23 of A_log plus the final rounding).
"""

import dataclasses
import hashlib
import json
import re
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from tokenizers import Tokenizer

import gguf_cases
import refimpl
from refimpl.errors import ConfigError, FormatError, WeightsError
from refimpl.formats import gguf as G
from refimpl.formats.gguf import ggml_types, names, reader, tensors, writer
from refimpl.formats.tokenizer import tokenizer_from_gguf
from refimpl.models.config import config_from_dict
from refimpl.models.model import Model
from refimpl.models.weights import Weights

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
ARCHS = ["qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe"]
IDS = np.array([gguf_cases.PROMPT])
LLAMACPP = np.load(FIXTURES / "llamacpp_logits.npz")


def f32_model(case: str) -> Model:
    """The fixture's HF checkpoint as a refimpl model (the HF arrays, no GGUF involved)."""
    return Model(config_from_dict(gguf_cases.CASES[case], source=case), Weights(gguf_cases.weights(case)))


def zero_centred(name: str) -> bool:
    return name.endswith("norm.weight") and ".linear_attn.norm" not in name


@pytest.mark.parametrize("case", ARCHS)
def test_f32_weights_are_the_hf_weights(case):
    cfg, arrays = G.load_gguf(FIXTURES / f"{case}-f32.gguf")
    hf = gguf_cases.weights(case)
    assert sorted(arrays) == sorted(hf)
    hybrid = cfg.is_hybrid
    for name, expected in hf.items():
        got = np.asarray(arrays[name])
        assert got.dtype == np.float32 and got.shape == expected.shape, name
        if hybrid and zero_centred(name):
            np.testing.assert_array_equal(np.float32(1) + got, np.float32(1) + expected, err_msg=name)
            assert np.abs(got - expected).max() <= 2.0 ** -24, name
        elif name.endswith(".A_log"):
            assert np.abs(got - expected).max() <= 2.0 ** -23 + 2.0 ** -22, name
        else:
            np.testing.assert_array_equal(got, expected, err_msg=name)


@pytest.mark.parametrize("case", ARCHS + ["qwen3-h256"])
def test_config_from_metadata_is_the_hf_config(case):
    stem = f"{case}-f32" if case != "qwen3-h256" else "qwen3-h256-q8_0"
    got = G.load_gguf(FIXTURES / f"{stem}.gguf")[0]
    expected = config_from_dict(gguf_cases.CASES[case], semantics="llama.cpp")
    assert got.semantics == "llama.cpp" and got.semantic_differences() == []   # these values mean the same to both
    assert got.to_dict() | {"source": ""} == expected.to_dict() | {"source": ""}


def test_f32_tensors_are_used_in_place():
    _, arrays = G.load_gguf(FIXTURES / "qwen3-f32.gguf")
    w = arrays["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(w, np.ndarray) and not w.flags.owndata and not w.flags.writeable


def test_only_the_tensor_asked_for_is_dequantised(monkeypatch):
    calls = []
    real = G.GGUFFile.array
    monkeypatch.setattr(G.GGUFFile, "array",
                        lambda self, name, index=None: calls.append(name) or real(self, name, index))
    model = refimpl.load(FIXTURES / "qwen3-h256-q4_k.gguf")
    assert calls and all(n.endswith("norm.weight") for n in calls)   # the F32 norms, as zero-copy views
    calls.clear()
    w = model.weights["model.layers.1.mlp.down_proj.weight"]
    assert calls == ["blk.1.ffn_down.weight"] and w.shape == (256, 256) and np.isfinite(w).all()


@pytest.mark.parametrize("stem", [k.removesuffix(".gguf") for k in sorted(f.name for f in FIXTURES.glob("*-f32.gguf"))]
                         + ["qwen3-h256-f32"])
def test_f32_logits_match_llamacpp(stem):
    """llama.cpp's logits (f32 KV cache, CPU) over gguf_cases.PROMPT, recorded by make_fixtures.py: <= 1e-4
    (measured <= 1.1e-5 at logits of size ~8-15)."""
    path = FIXTURES / f"{stem}.gguf"
    if path.exists():
        logits = refimpl.load(path).forward(IDS)[0]
    else:  # the F32 source of the quantised files is not committed: the same arrays, built from the seed
        logits = f32_model(stem.removesuffix("-f32")).forward(IDS)[0]
    assert np.isfinite(logits).all()
    assert np.abs(logits - LLAMACPP[stem]).max() <= 1e-4


QUANTISED = sorted(json.loads((FIXTURES / "ggml_dequantised.json").read_text()))


@pytest.mark.parametrize("stem", QUANTISED)
def test_quantised_logits_match_llamacpp_on_the_dequantised_weights(stem):
    """A file of llama.cpp's quantiser against llama.cpp on an F32 file of ggml's dequantisation of its tensors
    (make_fixtures.py): <= 1e-4 (measured <= 1.5e-5 at logits of size ~15). llama.cpp on the quantised file itself
    also quantises the activations to 8 bits (its CPU matmuls): <= 0.5 (measured 0.22-0.41)."""
    logits = refimpl.load(FIXTURES / f"{stem}.gguf").forward(IDS)[0]
    assert np.abs(logits).max() > 5
    assert np.abs(logits - LLAMACPP[f"{stem}-dequantised"]).max() <= 1e-4
    assert np.abs(logits - LLAMACPP[stem]).max() <= 0.5


@pytest.mark.parametrize("stem", QUANTISED)
def test_quantised_tensors_are_ggml_dequantisation_bit_for_bit(stem):
    """Every tensor of every committed file llama.cpp's quantiser wrote, as refimpl reads it, against ggml's own
    dequantisation (to_float; recorded as sha256 digests of the float32 bytes by make_fixtures.py). qwen3-every-type
    holds every block type the quantiser makes (gguf_cases.EVERY_TYPE), Q1_0 and Q2_0 included."""
    g = G.GGUFFile(FIXTURES / f"{stem}.gguf")
    digests = json.loads((FIXTURES / "ggml_dequantised.json").read_text())[stem]
    assert sorted(digests) == sorted(g.tensors)
    for name, digest in digests.items():
        a = np.ascontiguousarray(g.array(name), np.float32)
        assert hashlib.sha256(a.tobytes()).hexdigest() == digest, (name, G.type_name(g.tensors[name].ggml_type))
    if stem == "qwen3-every-type":
        types = {name: G.type_name(t.ggml_type) for name, t in g.tensors.items() if t.ggml_type != 0}
        assert types == gguf_cases.EVERY_TYPE and len(set(types.values())) == 27


@pytest.mark.parametrize("stem", [k for k in sorted(LLAMACPP.files) if k.startswith("preset-")])
def test_llamacpp_runs_the_files_refimpl_writes(stem, tmp_path):
    """make_fixtures.py ran llama.cpp on the presets as refimpl's writer writes them (no vocabulary; the first
    4096 logit columns kept). F32: <= 1e-4 at logits of size ~35 (measured <= 3.2e-5). Q8_0 / Q4_0: <= 1.0
    (measured 0.59 / 0.71: llama.cpp quantises the activations), while the unquantised model is 0.86 / 11.6 away."""
    preset, qtype = stem.removeprefix("preset-").rsplit("-", 1)
    ids = np.array([[5, 17, 123, 9999, 151000, 42]])
    model = refimpl.load(preset)
    if qtype != "f32":
        model = refimpl.load(G.write_gguf(tmp_path / "q.gguf", model, qtype.upper()))
    err = np.abs(model.forward(ids)[0, :, :4096] - LLAMACPP[stem]).max()
    assert err <= (1e-4 if qtype == "f32" else 1.0), err


# measured max |logits - F32 model's logits| (logits of size ~15) and max per-matrix relative RMS weight error
QUANT_BOUNDS = {"Q8_0": (0.4, 0.007), "Q6_K": (1.2, 0.022), "Q4_K": (4.0, 0.09), "Q4_0": (4.0, 0.10),
                "IQ4_XS": (4.0, 0.09)}


@pytest.mark.parametrize("qtype", gguf_cases.QUANT_TYPES)
def test_quantised_files_load_close_to_the_f32_model(qtype):
    """Measured: logits 0.28 (Q8_0), 0.90 (Q6_K), 2.9-3.1 (Q4_K, Q4_0, IQ4_XS) from the F32 model's (size 15);
    per-matrix relative RMS weight error 0.5 %, 1.8 %, 7-9 % (Gaussian weights: ~ step / sqrt(12))."""
    model = refimpl.load(FIXTURES / f"qwen3-h256-{qtype.lower()}.gguf")
    logits = model.forward(IDS)
    reference = f32_model("qwen3-h256")
    logit_bound, weight_bound = QUANT_BOUNDS[qtype]
    assert np.isfinite(logits).all()
    assert np.abs(logits - reference.forward(IDS)).max() <= logit_bound
    for name, w in reference.weights.stored.items():
        if w.ndim == 2:
            err = np.sqrt(np.mean((model.weights[name] - w) ** 2) / np.mean(w ** 2))
            assert 0 < err <= weight_bound, (name, err)
        else:   # llama.cpp keeps 1-D tensors (norms) in F32
            np.testing.assert_array_equal(model.weights[name], w, err_msg=name)


def test_every_block_type_dequantises_as_ggml_does():
    """quant-types.gguf: a [4, 256] matrix quantised by ggml to each block type it dequantises, beside ggml's own
    dequantisation: ours (gguf-py's; refimpl's kernels for Q1_0 and Q2_0, which gguf-py 0.19 lacks) is
    bit-identical for all 25, whole, one row at a time (the expert-slice path) and by an index array."""
    g = G.GGUFFile(FIXTURES / "quant-types.gguf")
    names = sorted(n[2:] for n in g.tensors if n.startswith("q."))
    assert len(names) == 25 and {"Q1_0", "Q2_0", "NVFP4", "MXFP4", "TQ1_0", "IQ1_M", "Q2_K"} <= set(names)
    assert {"Q1_0", "Q2_0"} == set(ggml_types.OWN_DEQUANTISERS)
    for t in names:
        assert G.unreadable(g.tensors[f"q.{t}"].ggml_type) is None, t
        ref = g.array(f"ref.{t}")
        np.testing.assert_array_equal(g.array(f"q.{t}").view(np.uint32), ref.view(np.uint32), err_msg=t)
        np.testing.assert_array_equal(g.array(f"q.{t}", 2), ref[2], err_msg=t)
        np.testing.assert_array_equal(g.array(f"q.{t}", np.array([[3, 0], [1, 1]])), ref[[[3, 0], [1, 1]]], err_msg=t)


def test_type_table_is_ggmls():
    """Every ggml type id's name, block size and bytes per block as ggml itself reports them (ggml_get_type_traits,
    recorded in quant-types.gguf): removed ids have block size 0."""
    m = G.GGUFFile(FIXTURES / "quant-types.gguf").metadata
    names, blocks, sizes = m["ggml.type_names"], m["ggml.type_block_sizes"], m["ggml.type_sizes"]
    assert len(names) == 43
    for i, (name, block, size) in enumerate(zip(names, blocks, sizes)):
        if block == 0:
            assert i in ggml_types.REMOVED_TYPES and i not in ggml_types.GGML_TYPES
        else:
            assert ggml_types.GGML_TYPES[i] == (name.upper(), block, size), i
    assert set(ggml_types.GGML_TYPES) | set(ggml_types.REMOVED_TYPES) == set(range(43))


def _retyped(tmp_path, ggml_type: int) -> Path:
    """qwen3-f32.gguf with blk.1.attn_q.weight [128, 64] (F32) declared as `ggml_type`."""
    name = b"blk.1.attn_q.weight"
    old = struct.pack("<Q", len(name)) + name + struct.pack("<I2QI", 2, 64, 128, 0)
    return _patch(FIXTURES / "qwen3-f32.gguf", tmp_path / f"t{ggml_type}.gguf", old,
                  old[:-4] + struct.pack("<I", ggml_type))


@pytest.mark.parametrize("ggml_type,why", [
    (77, r"type id 77, which this reader does not know \(ggml's types as of llama\.cpp 0\.3\.36: ids 0-42\)"),
    (31, r"Q4_0_4_4 \(type id 31\), which ggml has removed"),
    (9, r"Q8_1, ggml's activation format"),
    (26, r"I32, an integer type, not a weight")])
def test_unreadable_type_is_listed_and_refused_when_used(tmp_path, ggml_type, why):
    """The header never fails on a type: the file opens and `refimpl info` lists the tensor; loading the model
    names it (strict, the default), or reading it does (strict=False)."""
    path = _retyped(tmp_path, ggml_type)
    g = G.GGUFFile(path)
    assert G.type_name(g.tensors["blk.1.attn_q.weight"].ggml_type) in (f"type id {ggml_type}", "Q4_0_4_4", "Q8_1",
                                                                      "I32")
    message = rf"t{ggml_type}\.gguf: tensor 'blk\.1\.attn_q\.weight' has {why}"
    with pytest.raises(WeightsError, match=message):
        refimpl.load(path)
    model = refimpl.load(path, strict=False)
    assert np.asarray(model.weights["model.layers.0.self_attn.q_proj.weight"]).shape == (128, 64)
    with pytest.raises(WeightsError, match=message):
        model.forward(IDS)
    proc = _cli("info", str(path))
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"unreadable   tensor 'blk\.1\.attn_q\.weight' has " + why, proc.stdout), proc.stdout
    proc = _cli("run", str(path), "--input-ids", "1,2")
    assert proc.returncode == 2 and re.search(message, proc.stderr) and proc.stderr.count("\n") == 1


def test_lazy_tensors_read_parts_as_the_whole(caplog):
    """Every lazily read tensor (MoE stacks, hybrid transforms, a quantised file) gives part `index` of its leading
    axis equal to that part of the whole, and reports the bytes it takes in the file."""
    for path in ("qwen35moe-f32.gguf", "qwen3next-f32.gguf", "qwen3moe-f32.gguf", "qwen3-every-type.gguf"):
        g = G.GGUFFile(FIXTURES / path)
        _, arrays = G.load_gguf(FIXTURES / path)
        lazy = {k: a for k, a in arrays.items() if isinstance(a, tensors.LazyTensor)}
        assert lazy
        for name, a in lazy.items():
            whole = a.read()
            assert whole.shape == a.shape and whole.dtype == np.float32
            last = a.shape[0] - 1
            for index in (last, slice(0, 2), np.array([[last, 0]])):
                np.testing.assert_array_equal(a.read(index), whole[index], err_msg=name)
        stored = sum(a.nbytes for a in arrays.values())
        assert stored == sum(t.nbytes for t in g.tensors.values()), path


# ---------------------------------------------------------------------------------------------------- writer

@pytest.mark.parametrize("case", ARCHS)
def test_writer_reproduces_the_llamacpp_converter(case, tmp_path):
    """Our writer on the HF arrays gives the converter's file: same tensors (names, shapes, types, values; ssm_a
    within an ulp, as numpy's and torch's exp may differ) and the same metadata, but the file name and
    full_attention_interval (the converter writes 4 whatever the model; recurrent_layers, written by both,
    is what llama.cpp reads)."""
    ref = G.GGUFFile(FIXTURES / f"{case}-f32.gguf")
    path = G.write_gguf(tmp_path / "out.gguf", f32_model(case), "F32", tokenizer=G.tokenizer_metadata(ref))
    out = G.GGUFFile(path)
    assert sorted(out.tensors) == sorted(ref.tensors)
    for name, t in ref.tensors.items():
        a, b = out.array(name), ref.array(name)
        assert (out.tensors[name].shape, out.tensors[name].ggml_type) == (t.shape, t.ggml_type), name
        if name.endswith("ssm_a"):
            np.testing.assert_array_max_ulp(a, b, maxulp=1)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    skip = {"general.name", "general.size_label", "general.type", f"{ref.architecture}.full_attention_interval"}
    assert sorted(set(out.metadata) - skip) == sorted(set(ref.metadata) - skip)
    for key in set(ref.metadata) - skip:
        got, expected = out.metadata[key], ref.metadata[key]
        assert (np.array_equal(got, expected) if isinstance(expected, np.ndarray) else list(got) == list(expected)
                if isinstance(expected, reader.StringArray) else got == expected), key


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-next", "tiny-qwen3.5",
                                    "tiny-qwen3.5-moe"])
def test_preset_round_trip_f32(preset, tmp_path):
    """Preset -> GGUF F32 -> refimpl: identical weights (zero-centred norms and A_log as above) and logits
    (bit for bit for Qwen3 / Qwen3-MoE; hybrids <= 1e-5 of logits ~40, from those two float32 round trips)."""
    model = refimpl.load(preset)
    back = refimpl.load(G.write_gguf(tmp_path / f"{preset}.gguf", model, "F32"))
    same = {"source": "", "semantics": ""}   # the GGUF has llama.cpp's semantics: the same model for these values
    assert back.config.to_dict() | same == model.config.to_dict() | same and back.config.semantic_differences() == []
    for name in model.weights.stored:
        if name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name and name not in back.weights:
            continue   # per-expert in the GGUF round trip: compared through expert() below
        got, expected = back.weights[name], model.weights[name]
        if model.config.is_hybrid and zero_centred(name):
            np.testing.assert_array_equal(np.float32(1) + got, np.float32(1) + expected, err_msg=name)
        elif name.endswith(".A_log"):
            assert np.abs(got - expected).max() <= 2.0 ** -22, name
        else:
            np.testing.assert_array_equal(got, expected, err_msg=name)
    for i in range(model.config.num_hidden_layers):
        if model.config.is_moe_layer(i):
            for e in range(model.config.num_experts):
                for a, b in zip(back.weights.expert(f"model.layers.{i}.mlp.experts", e),
                                model.weights.expert(f"model.layers.{i}.mlp.experts", e)):
                    np.testing.assert_array_equal(a, b)
    ids = np.array([[5, 17, 123, 9999, 151000]])
    logits = model.forward(ids)
    err = np.abs(back.forward(ids) - logits).max()
    # hybrids: a few float32 ulps of the logits (measured 2.4e-7 - 3.3e-7 of max |logits|)
    assert err == 0 if not model.config.is_hybrid else err <= 1e-6 * np.abs(logits).max()


def test_older_and_fused_layouts_read_the_same(tmp_path):
    """llama.cpp also loads a fused ffn_gate_up_exps ([E, 2Ie, H]; convert --fuse-gate-up-exps) and, for
    Qwen3-Next, the unsplit grouped ssm_in of older conversions: both give the same HF arrays."""
    def fuse(t):
        for i in range(2):
            t[f"blk.{i}.ffn_gate_up_exps.weight"] = np.concatenate(
                [t.pop(f"blk.{i}.ffn_gate_exps.weight"), t.pop(f"blk.{i}.ffn_up_exps.weight")], axis=1)

    def unsplit(t):
        t["blk.0.ssm_in.weight"] = names.regroup_qkvz(t.pop("blk.0.attn_qkv.weight"), t.pop("blk.0.attn_gate.weight"),
                                                  2, 16, 2 * 16)
    for case, edit in (("qwen3moe", fuse), ("qwen35moe", fuse), ("qwen3next", unsplit)):
        model = f32_model(case)
        edited = refimpl.load(gguf_cases.write_gguf_with(tmp_path / f"{case}.gguf", model, edit=edit))
        assert "blk.0.ffn_gate_up_exps.weight" in G.GGUFFile(tmp_path / f"{case}.gguf").tensors or case == "qwen3next"
        np.testing.assert_array_equal(edited.forward(IDS), refimpl.load(FIXTURES / f"{case}-f32.gguf").forward(IDS))


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                   "rope_theta": 1e6}])
def test_scaled_rope_round_trips(rope, tmp_path):
    """What llama.cpp reads of the rope round-trips exactly (YaRN's betas and attention factor do not:
    test_llamacpp_semantics)."""
    cfg = config_from_dict({**gguf_cases.CASES["qwen3"], "rope_parameters": rope})
    model = Model(cfg, Weights(gguf_cases.weights("qwen3")))
    back = refimpl.load(G.write_gguf(tmp_path / "r.gguf", model))
    assert back.config.rope == cfg.rope
    np.testing.assert_array_equal(back.forward(IDS), model.forward(IDS))


@pytest.mark.parametrize("name", sorted(gguf_cases.SEMANTICS))
def test_llamacpp_semantics(name, tmp_path, caplog):
    """A GGUF runs as llama.cpp runs it where llama.cpp and transformers differ (gguf_cases.SEMANTICS: M-RoPE pairs
    no section covers, the Gated DeltaNet l2norm eps, YaRN keys llama.cpp does not read, a scaling factor without a
    type): refimpl on the file against llama.cpp's recorded logits <= 1e-4 (measured <= 5.8e-6), while the HF
    checkpoint's model (transformers' semantics, test_gguf_oracle.py) is measurably elsewhere (measured 5.4e-3 for
    M-RoPE [3, 2, 1] ... 4.1 for YaRN): the difference is real, and the file's side of it is llama.cpp's. Loading
    says so in one line."""
    path = gguf_cases.write_semantics_gguf(name, tmp_path / f"{name}.gguf")
    expected = LLAMACPP[f"semantics-{name}"]
    with caplog.at_level("WARNING", logger="refimpl"):
        gguf = refimpl.load(path)
    err = np.abs(gguf.forward(IDS)[0] - expected).max()
    hf_err = np.abs(gguf_cases.semantics_model(name).forward(IDS)[0] - expected).max()
    assert err <= 1e-4 and hf_err > 20 * 1e-4, (err, hf_err)
    notes = [r.getMessage() for r in caplog.records if r.name.startswith("refimpl")]
    assert len(notes) == 1 and "\n" not in notes[0] and notes[0].startswith(f"{path}: runs as llama.cpp runs it: ")
    assert gguf.config.semantics == "llama.cpp"


def test_llamacpp_semantics_properties():
    """The named properties that carry each difference, on both sides."""
    hf = {name: gguf_cases.semantics_model(name).config for name in gguf_cases.SEMANTICS}
    gg = {name: dataclasses.replace(cfg, semantics="llama.cpp") for name, cfg in hf.items()}
    assert hf["qwen35-mrope321"].mrope_pair_axes == (0, 1, 2, 0, 1, 0, 0, 0)      # uncovered: temporal
    assert gg["qwen35-mrope321"].mrope_pair_axes == (0, 1, 2, 0, 1, 3, 0, 1)      # sector j mod 6; 5: the fourth
    assert gg["qwen35-mrope330"].mrope_pair_axes == (0, 1, 3, 0, 1, 3, 0, 1)
    assert hf["qwen35-eps1e-2"].linear_l2norm_eps == 1e-6 and gg["qwen35-eps1e-2"].linear_l2norm_eps == 1e-2
    assert all(cfg.semantic_differences() == [] for cfg in hf.values())
    assert "rotary pairs [2, 5] of 8 stay unrotated" in gg["qwen35-mrope330"].semantic_differences()[0]
    released = config_from_dict({**gguf_cases.CASES["qwen35"], "head_dim": 256, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}, semantics="llama.cpp")
    assert released.mrope_section == (11, 11, 10) and 3 not in released.mrope_pair_axes   # released models agree
    assert released.semantic_differences() == []


def test_qwen3_partial_rotary_gguf_is_refused(tmp_path):
    """llama.cpp's qwen3 asserts rope.dimension_count == head dim (it aborts otherwise): such a file is refused."""
    path = gguf_cases.write_gguf_with(tmp_path / "rot.gguf", f32_model("qwen3"),
                                      {"qwen3.rope.dimension_count": ("UINT32", 16)})
    with pytest.raises(ConfigError, match=r"rot\.gguf: qwen3\.rope\.dimension_count 16 differs from the head dim 32"):
        refimpl.load(path)


def test_writer_notes_what_llamacpp_runs_otherwise(tmp_path):
    """Converting an HF model whose meaning llama.cpp does not keep says what changes, in one line on stderr."""
    out = tmp_path / "yarn.gguf"
    directory = tmp_path / "hf"
    gguf_cases.write_checkpoint("qwen3", directory)
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = gguf_cases.SEMANTICS["qwen3-yarn"][0]["rope_parameters"]
    (directory / "config.json").write_text(json.dumps(config))
    proc = _cli("convert", str(directory), "--to", "gguf", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"refimpl: note: {out}: llama.cpp runs it "
                                                                     f"otherwise than {directory / 'config.json'}: ")
    assert "rope.beta_fast 8.0 -> unset" in proc.stderr and "rope.attention_factor 1.25 -> unset" in proc.stderr
    proc = _cli("convert", "tiny-qwen3.5", "--to", "gguf", "--out", str(tmp_path / "same.gguf"))
    assert proc.returncode == 0 and proc.stderr == ""


def _block_bound(w: np.ndarray, qtype: str) -> np.ndarray:
    """Per element, the largest error gguf-py's (= ggml's reference) quantiser can make, from its block's
    amax: Q8_0 rounds to d = amax/127 (<= d/2); Q4_0 uses d = -max/8 over [-8d, 7d], so the value opposite the
    max can be clipped (<= |d|); plus the f16 rounding of d times the largest code (127 or 8)."""
    blocks = w.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True).astype(np.float64)
    d, step, code = (amax / 127, 0.5, 127) if qtype == "Q8_0" else (amax / 8, 1.0, 8)
    return np.broadcast_to(d * (step + code * 2.0 ** -11) + 1e-12, blocks.shape).reshape(w.shape)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("case", ARCHS)
def test_writer_quantises_within_the_quantisers_bound(case, qtype, tmp_path):
    """Every quantised element within its block's bound (the real check); the logits stay finite, and at
    hidden 64 with Gaussian weights move by (measured) <= 2.7 % (Q8_0) and <= 56 % (Q4_0) of max |logits|."""
    model = f32_model(case)
    path = G.write_gguf(tmp_path / "q.gguf", model, qtype)
    g = G.GGUFFile(path)
    assert {G.type_name(t.ggml_type) for t in g.tensors.values()} == {"F32", qtype}
    assert g.metadata["general.file_type"] == {"Q8_0": 7, "Q4_0": 2}[qtype]
    expected = writer.hf_to_gguf_tensors(model.config, model.weights)
    for name, t in g.tensors.items():
        got = g.array(name)
        if G.type_name(t.ggml_type) == "F32":
            np.testing.assert_array_equal(got, expected[name], err_msg=name)
        else:
            assert (np.abs(got - expected[name]) <= _block_bound(expected[name], qtype)).all(), name
    back = refimpl.load(path)
    if model.config.num_experts:   # one expert of a quantised stack is dequantised alone: the same values
        for e in range(model.config.num_experts):
            gate, up, down = back.weights.expert("model.layers.1.mlp.experts", e)
            np.testing.assert_array_equal(down, g.array("blk.1.ffn_down_exps.weight")[e])
            np.testing.assert_array_equal(up, g.array("blk.1.ffn_up_exps.weight")[e])
    logits = back.forward(IDS)
    assert np.isfinite(logits).all()
    reference = model.forward(IDS)
    assert np.abs(logits - reference).max() <= {"Q8_0": 0.04, "Q4_0": 0.75}[qtype] * np.abs(reference).max()


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_writer_half_types_round_to_the_type(qtype, tmp_path):
    model = f32_model("qwen3")
    back = refimpl.load(G.write_gguf(tmp_path / "h.gguf", model, qtype))
    dtype = {"F16": np.float16, "BF16": ml_dtypes.bfloat16}[qtype]
    for name, w in model.weights.stored.items():
        expected = w if w.ndim == 1 else w.astype(dtype).astype(np.float32)
        np.testing.assert_array_equal(back.weights[name], expected, err_msg=name)


# ---------------------------------------------------------------------------------------------------- tokenizer

@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vocab")
    with tarfile.open(FIXTURES / "vocab-qwen.tar.xz") as tar:
        for member in tar.getmembers():
            assert member.isfile() and "/" not in member.name
            (directory / member.name).write_bytes(tar.extractfile(member).read())
    return directory


@pytest.mark.parametrize("name", ["qwen2", "qwen35"])
def test_tokenizer_passes_llamacpp_test_vectors(vocab_dir, name):
    """llama.cpp's models/ggml-vocab-{name}.gguf.inp / .out (made with the HF tokenizers): every case."""
    tok = tokenizer_from_gguf(vocab_dir / f"ggml-vocab-{name}.gguf")
    texts = (vocab_dir / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = (vocab_dir / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) > 40
    for text, ids in zip(texts, expected, strict=True):
        assert tok.encode(text, add_special_tokens=False).ids == [int(t) for t in ids.split()], repr(text)


def test_tokenizer_metadata_is_plain_data():
    meta = G.tokenizer_metadata(FIXTURES / "qwen35-f32.gguf")
    assert meta["model"] == "gpt2" and meta["pre"] == "qwen35" and meta["eos_token_id"] == 302
    assert meta["pad_token_id"] == 300 and meta["bos_token_id"] is None and "<|im_start|>" in meta["chat_template"]
    assert type(meta["tokens"]) is list and type(meta["merges"]) is list and type(meta["token_types"]) is list
    assert len(meta["tokens"]) == gguf_cases.VOCAB and meta["tokens"][302] == "<|im_end|>"
    assert meta["token_types"][302] == 3 and meta["token_types"][310] == 5   # control; unused padding


def test_tokenizer_from_tiny_gguf_matches_its_tokenizer_json():
    hf = Tokenizer.from_str(gguf_cases.tokenizer_json())
    tok = tokenizer_from_gguf(G.tokenizer_metadata(FIXTURES / "qwen3-f32.gguf"))
    for text in ["Hello world! It's 2026.", "  the  quick\n\nfox<|im_end|>", "Ünïcödé 123456 résumé"]:
        assert tok.encode(text).ids == hf.encode(text).ids, text
    assert tok.decode(tok.encode("Hello world!").ids) == "Hello world!"


def test_tokenizer_adds_bos_and_eos_when_the_gguf_asks():
    meta = G.tokenizer_metadata(FIXTURES / "qwen3-f32.gguf")
    plain = tokenizer_from_gguf(meta).encode("Hello world").ids
    assert plain == tokenizer_from_gguf(meta | {"add_bos_token": False, "bos_token_id": 301}).encode("Hello world").ids
    both = tokenizer_from_gguf(meta | {"add_bos_token": True, "bos_token_id": 301, "add_eos_token": True})
    assert both.encode("Hello world").ids == [301, *plain, 302]
    assert both.encode("Hello world", add_special_tokens=False).ids == plain


def test_tokenizer_rejects_unknown_pre_tokenizer():
    meta = G.tokenizer_metadata(FIXTURES / "qwen3-f32.gguf") | {"pre": "llama-bpe"}
    with pytest.raises(ConfigError, match="unsupported tokenizer.ggml.pre 'llama-bpe'"):
        tokenizer_from_gguf(meta)


def big_vocabulary_gguf(path: Path, V: int = 250_000) -> Path:
    """A header-only qwen35 GGUF with a V-token vocabulary, V merges and a zero embedding (bench/gguf_open.py
    times opening it against gguf-py's reader)."""
    def string(text):
        return struct.pack("<Q", len(text.encode())) + text.encode()

    def strings(key, items):
        return string(key) + struct.pack("<IIQ", 9, 8, len(items)) + b"".join(map(string, items))
    header = b"".join([
        b"GGUF", struct.pack("<IQQ", 3, 1, 6),
        string("general.architecture") + struct.pack("<I", 8) + string("qwen35"),
        string("tokenizer.ggml.model") + struct.pack("<I", 8) + string("gpt2"),
        string("tokenizer.ggml.pre") + struct.pack("<I", 8) + string("qwen35"),
        strings("tokenizer.ggml.tokens", [f"tok{i}" for i in range(V)]),
        string("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 5, V) + np.ones(V, "<i4").tobytes(),
        strings("tokenizer.ggml.merges", [f"t{i} k{i}" for i in range(V)]),
        string("token_embd.weight") + struct.pack("<I2QIQ", 2, 2, V, 0, 0)])
    path.write_bytes(header + bytes(-len(header) % 32) + bytes(V * 2 * 4))
    return path


def test_a_250k_vocabulary_is_read_lazily(tmp_path):
    """Opening reads only the strings' offsets; they are decoded (all at once) on first use, and correctly.
    (How fast: bench/gguf_open.py, against gguf-py's GGUFReader.)"""
    V = 250_000
    g = G.GGUFFile(big_vocabulary_gguf(tmp_path / "big.gguf", V))
    tokens = g.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, reader.StringArray) and tokens._items is None and len(tokens) == V   # not decoded yet
    meta = G.tokenizer_metadata(g)
    assert meta["tokens"][123456] == "tok123456" and meta["merges"][-1] == f"t{V - 1} k{V - 1}"
    assert len(meta["tokens"]) == len(meta["merges"]) == len(meta["token_types"]) == V


# ---------------------------------------------------------------------------------------------------- bad input

def _patch(src: Path, dst: Path, old: bytes, new: bytes) -> Path:
    data = src.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    dst.write_bytes(data.replace(old, new))
    return dst


@pytest.mark.parametrize("cut", [3, 30, 2000, 10000, -1000])
def test_truncated_file_is_a_format_error(tmp_path, cut):
    data = (FIXTURES / "qwen3-f32.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(FormatError, match=r"cut\.gguf: (truncated|not a GGUF)") as e:
        refimpl.load(path)
    assert "\n" not in str(e.value)
    if cut == -1000:
        assert "tensor 'output_norm.weight'" in str(e.value) or "tensor 'blk." in str(e.value)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(FormatError, match=r"x\.gguf: not a GGUF file"):
        refimpl.load(tmp_path / "x.gguf")


def test_unknown_architecture_is_a_config_error(tmp_path):
    key = b"general.architecture"
    old = key + struct.pack("<IQ", 8, 5) + b"qwen3"
    path = _patch(FIXTURES / "qwen3-f32.gguf", tmp_path / "arch.gguf", old, old[:-5] + b"llama")
    with pytest.raises(ConfigError, match=r"arch\.gguf: unknown architecture 'llama'.*supported: qwen3, qwen3moe"):
        refimpl.load(path)


def test_vocabulary_embedding_mismatch_is_a_weights_error(tmp_path, monkeypatch):
    meta = G.tokenizer_metadata(FIXTURES / "qwen3-f32.gguf")
    meta["tokens"], meta["token_types"] = meta["tokens"][:-20], meta["token_types"][:-20]
    with pytest.raises(WeightsError, match="tokenizer has 300 tokens but the embedding 'model.embed_tokens.weight' "
                                          "has 320 rows"):
        G.write_gguf(tmp_path / "v.gguf", f32_model("qwen3"), tokenizer=meta)
    assert list(tmp_path.iterdir()) == []          # nothing written, no temporary file left
    monkeypatch.setattr(writer, "_check_tokenizer", lambda cfg, tokenizer: None)
    path = G.write_gguf(tmp_path / "v.gguf", f32_model("qwen3"), tokenizer=meta)
    with pytest.raises(WeightsError, match=r"v\.gguf: tensor 'token_embd\.weight' has 320 rows but "
                                           r"tokenizer\.ggml\.tokens has 300 entries"):
        refimpl.load(path)


def test_missing_tensor_names_the_gguf_tensor(tmp_path):
    name = b"blk.0.ffn_down.weight"
    path = _patch(FIXTURES / "qwen3-f32.gguf", tmp_path / "m.gguf", name, b"blk.0.ffn_dowX.weight")
    with pytest.raises(WeightsError, match=r"m\.gguf: missing tensor 'blk\.0\.ffn_down\.weight'"):
        refimpl.load(path)


def test_writer_leaves_no_partial_file(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(writer, "encode_tensor", boom)
    monkeypatch.chdir(tmp_path)   # a short path: the message quotes at most 80 characters of it
    with pytest.raises(FormatError, match=r"p\.gguf'?: cannot write the GGUF file \(disk full\)"):
        G.write_gguf("p.gguf", f32_model("qwen3"), "Q8_0")
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_unsupported_type(tmp_path):
    with pytest.raises(ConfigError, match=r"p\.gguf: unsupported GGUF type 'Q4_K'; supported: F32, F16, BF16, Q8_0, "
                                          r"Q4_0"):
        G.write_gguf(tmp_path / "p.gguf", f32_model("qwen3"), "q4_k")
    assert list(tmp_path.iterdir()) == []


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "refimpl.cli", *argv], capture_output=True, text=True)


def test_info_reports_stored_and_dequantised_sizes():
    """`refimpl info` on a quantised file: the bytes its tensors take in the file (per type, from the header) apart
    from their size once dequantised to float32."""
    path = FIXTURES / "qwen3-h256-q4_k.gguf"
    g = G.GGUFFile(path)
    stored = sum(t.nbytes for t in g.tensors.values())
    proc = _cli("info", str(path))
    assert proc.returncode == 0, proc.stderr
    n = sum(int(np.prod(t.shape)) for t in g.tensors.values())
    assert f"parameters   {n:,} ({stored / 2**20:.1f} MiB stored, {4 * n / 2**20:.1f} MiB as float32)" in proc.stdout
    assert stored < path.stat().st_size < stored + 16 * 1024 and 4 * n > 6 * stored   # the rest: header, padding
    kinds = {k: (count, size) for k, count, size in g.storage()}
    assert kinds == {"Q4_K": (12, 387072), "Q6_K": (3, 147840), "F32": (9, 6144)}   # Q4_K_M: v, down, embd in Q6_K
    assert "tensors by type: Q4_K 0.4 MiB (12), Q6_K 0.1 MiB (3), F32 6.0 KiB (9)" in proc.stdout
    assert "semantics    llama.cpp" in proc.stdout
    proc = _cli("info", str(FIXTURES / "qwen3-every-type.gguf"))   # Q2_0 was an unknown id to gguf-py 0.19's reader
    assert proc.returncode == 0 and "Q2_0 9.0 KiB (1)" in proc.stdout and "Q1_0 4.5 KiB (1)" in proc.stdout


def test_cli_runs_a_gguf_and_converts(tmp_path):
    proc = _cli("info", str(FIXTURES / "qwen35moe-f32.gguf"))
    assert proc.returncode == 0 and "qwen3_5_moe_text" in proc.stdout and "4 x 32, top-2" in proc.stdout
    out = tmp_path / "t.gguf"
    proc = _cli("convert", "tiny-qwen3", "--to", "gguf", "--out", str(out), "--type", "q8_0")
    assert proc.returncode == 0, proc.stderr
    assert G.type_name(G.GGUFFile(out).tensors["blk.0.attn_q.weight"].ggml_type) == "Q8_0"


@pytest.mark.parametrize("argv,message", [
    (["info", "{fixtures}/missing.gguf"], "missing.gguf: no such file"),
    (["run", "{bad}", "--input-ids", "1"], "truncated"),
    (["convert", "tiny-qwen3", "--to", "gguf", "--out", "{tmp}/o.gguf", "--type", "q4_k"], "invalid choice"),
    (["convert", "nowhere", "--to", "gguf", "--out", "{tmp}/o.gguf"], "not a preset"),
])
def test_cli_bad_gguf_input_exits_2_with_one_line(tmp_path, argv, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes((FIXTURES / "qwen3-f32.gguf").read_bytes()[:5000])
    argv = [a.format(fixtures=FIXTURES, bad=bad, tmp=tmp_path) for a in argv]
    proc = _cli(*argv)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o.gguf").exists() and not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))


def test_wrong_tensor_shape_names_the_gguf_tensor(tmp_path):
    def shrink(t):
        t["blk.0.ssm_out.weight"] = t["blk.0.ssm_out.weight"][:, :32]
    path = gguf_cases.write_gguf_with(tmp_path / "s.gguf", f32_model("qwen35"), edit=shrink)
    with pytest.raises(WeightsError, match=r"s\.gguf: tensor 'blk\.0\.ssm_out\.weight' has shape \[64, 32\], "
                                           r"expected \[64, 64\]"):
        refimpl.load(path)


def test_absurd_string_count_is_a_one_line_error(tmp_path):
    """A corrupt vocabulary count is a FormatError before any allocation (not a MemoryError)."""
    src = FIXTURES / "qwen3-f32.gguf"
    data = bytearray(src.read_bytes())
    g = G.GGUFFile(src)
    assert "tokenizer.ggml.tokens" in g.metadata
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key) + 4 + 4          # key, value type (array), element type (string): the count
    struct.pack_into("<Q", data, at, 2**40)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="claims 1099511627776 strings"):
        refimpl.load(bad)


def test_writer_keeps_every_special_token_id(tmp_path):
    """bos / eos / pad / unk ids survive write -> read under llama.cpp's key names (unknown_token_id)."""
    meta = G.tokenizer_metadata(FIXTURES / "qwen3-f32.gguf")
    meta = {**meta, "unk_token_id": 7, "pad_token_id": 5}
    model = refimpl.load(FIXTURES / "qwen3-f32.gguf")
    path = G.write_gguf(tmp_path / "t.gguf", model, "F32", tokenizer=meta)
    back = G.tokenizer_metadata(path)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert back[key] == meta[key], key
