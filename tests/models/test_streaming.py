"""Streamed weights give the same bits as resident ones.

Every preset architecture is written as a bf16 checkpoint (what released checkpoints are) and loaded twice:
resident (the default for a model this small) and streamed under the smallest budget the model accepts (its
largest piece), which keeps nothing: every layer's tensors are converted when the layer runs and dropped after,
the embedding is gathered row by row, lm_head runs in row blocks and MoE layers convert only the routed experts.
Forward, cached decode, golden bundles in every convention, generate, replay and explain must agree bit for bit.
"""

import filecmp
import json
import math
import re
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import refimpl
from refimpl import progress
from refimpl.bundle import read_bundle
from refimpl.cli import main
from refimpl.diff.dump import read_dump
from refimpl.diff.explain import explain
from refimpl.diff.replay import replay, run_step
from refimpl.errors import WeightsError
from refimpl.formats.safetensors import read_safetensors, write_safetensors
from refimpl.golden import write_golden
from refimpl.kernels import products
from refimpl.kernels.linear import linear
from refimpl.models import weights as W
from refimpl.models.config import config_from_dict
from refimpl.models.stored import bf16_to_float32
from refimpl.precision import Policy
from refimpl.presets import PRESETS, random_weights, save_preset

ARCHS = list(PRESETS)
PROMPT = [9707, 11, 1879, 0, 315, 3460, 13, 576, 220]


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    return {name: save_preset(name, root / name, dtype="bfloat16") for name in ARCHS}


def pair(directory, **kw):
    """(resident model, streamed model) of one checkpoint; the streamed one keeps nothing."""
    resident = refimpl.load(directory, **kw)
    assert resident.weights.resident
    smallest = resident.weights.plan()[1]
    streamed = refimpl.load(directory, max_resident_bytes=smallest, **kw)
    assert not streamed.weights.resident
    return resident, streamed


def assert_streamed(model, forwards: int):
    """Nothing kept, and every tensor but the experts (only the routed ones) converted again on each forward."""
    w = model.weights
    assert w.kept_nbytes == 0
    assert w.conversions >= forwards * sum(".experts." not in name for name in w.stored)


def test_bf16_to_float32_is_the_exact_widening_for_every_bit_pattern():
    bits = np.arange(2**16, dtype=np.uint16)
    a = bits.view(ml_dtypes.bfloat16)
    got = bf16_to_float32(a)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32) >> 16, bits)          # NaN payloads and -0 too
    finite = np.isfinite(got)
    np.testing.assert_array_equal(got[finite], a[finite].astype(np.float32))  # ml_dtypes' cast agrees
    assert (got.view(np.uint32)[~finite] & 0xFFFF).max() == 0


@pytest.mark.parametrize("name", ARCHS)
def test_forward_and_cached_decode_streamed_equal_resident(name, bf16_dirs):
    resident, streamed = pair(bf16_dirs[name])
    ids = np.array([PROMPT, [0, 0, 0] + PROMPT[:6]])
    mask = np.array([[1] * 9, [0, 0, 0] + [1] * 6])
    np.testing.assert_array_equal(streamed.forward(ids, attention_mask=mask),
                                  resident.forward(ids, attention_mask=mask))
    caches = resident.new_cache(2), streamed.new_cache(2)
    steps = [(ids, mask)] + [(np.array([[t], [t + 1]]), None) for t in (17, 4000, 99)]
    for x, m in steps:
        a = resident.forward(x, cache=caches[0], attention_mask=m)
        b = streamed.forward(x, cache=caches[1], attention_mask=m)
        np.testing.assert_array_equal(b, a)
    assert_streamed(streamed, forwards=5)


@pytest.mark.parametrize("name", ARCHS)
def test_golden_in_every_convention_streamed_equals_resident(name, bf16_dirs, tmp_path):
    resident, streamed = pair(bf16_dirs[name])
    runs = {"hf": {}, "genie": {"ar": 4, "cl": 16}, "qeff": {"seq_len": 4, "ctx_len": 16}}
    for convention, params in runs.items():
        out = {}
        for which, model in (("resident", resident), ("streamed", streamed)):
            out[which] = write_golden(tmp_path / f"{convention}-{which}", model, PROMPT[:6],
                                      source=str(bf16_dirs[name]), convention=convention, params=params,
                                      decode_steps=2, taps=".")
        cmp = filecmp.dircmp(out["resident"], out["streamed"])
        _assert_same_tree(cmp)
    assert streamed.weights.kept_nbytes == 0


def _assert_same_tree(cmp):
    assert not cmp.left_only and not cmp.right_only, (cmp.left_only, cmp.right_only)
    _, mismatch, errors = filecmp.cmpfiles(cmp.left, cmp.right, cmp.common_files, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
    for sub in cmp.subdirs.values():
        _assert_same_tree(sub)


@pytest.mark.parametrize("name", ARCHS)
def test_generate_streamed_equals_resident(name, bf16_dirs):
    resident, streamed = pair(bf16_dirs[name])
    kw = dict(max_new_tokens=4, temperature=0.8, top_p=0.9, top_k=50, seed=3, eos_token_id=(), return_logits=True)
    a = refimpl.generate(resident, [PROMPT, PROMPT[:5]], **kw)
    b = refimpl.generate(streamed, [PROMPT, PROMPT[:5]], **kw)
    assert b.tokens == a.tokens and b.logprobs == a.logprobs and b.uniforms == a.uniforms
    for x, y in zip(a.logits, b.logits):
        np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen3.5"])
def test_replay_and_explain_streamed_equal_resident(name, bf16_dirs, tmp_path):
    from refimpl.diff import load_policy
    resident, streamed = pair(bf16_dirs[name])
    path = write_golden(tmp_path / "b", resident, PROMPT[:6], source=str(bf16_dirs[name]), convention="genie",
                        params={"ar": 4, "cl": 16}, decode_steps=1, taps=".")
    bundle = read_bundle(path)
    dump = read_dump(path, bundle)
    policy = load_policy(None, None)
    a, _ = run_step(bundle, dump, resident, 1, policy)
    b, _ = run_step(bundle, dump, streamed, 1, policy)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    rows = [replay(bundle, dump, m, layer=1) for m in (resident, streamed)]
    assert [(r.step, r.name, r.total, r.inherited, r.added) for r in rows[0]] == \
        [(r.step, r.name, r.total, r.inherited, r.added) for r in rows[1]]
    for spec in ("model.layers.3.self_attn.q_norm[0,1,2,5]", "model.layers.0.mlp.down_proj[0,2,7]" if "moe" not in name
                 else "model.layers.0.mlp.router_logits[0,2,3]", "lm_head[0,3,151]"):
        assert explain(bundle, streamed, spec) == explain(bundle, resident, spec)
    assert streamed.weights.kept_nbytes == 0


POLICIES = [("tiny-qwen3", "float64"), ("tiny-qwen3.5-moe", "float64"), ("tiny-qwen3-next", "bf16"),
            ("tiny-qwen3", {"weights": "int8-per-tensor-qnn"}),         # tied lm_head quantised on its own
            ("tiny-qwen3.5-moe", {"weights": "int8-per-tensor-qnn"}),   # fused experts: one range per tensor
            ("tiny-qwen3.5-moe", {"weights": "int4-block32-onnx"})]


@pytest.mark.parametrize("name,precision", POLICIES, ids=[f"{n}-{p}" for n, p in POLICIES])
def test_precision_policies_streamed_equal_resident(name, precision, bf16_dirs, monkeypatch):
    """Weight emulation on parts (an expert of a fused tensor, row blocks: lm_head's 1 MiB ones here, so the
    151936-row head runs in 5-10 blocks, and for one token every matrix's 4 KiB ones) gives that part of the
    emulated whole tensor."""
    monkeypatch.setattr(W, "ROW_BLOCK_BYTES", 2**20)
    monkeypatch.setattr(W, "VECTOR_BLOCK_BYTES", 2**12)   # one token: every matrix in 4 KiB row blocks
    kw = {"dtype": "float64"} if precision == "float64" else {"precision": precision}
    resident, streamed = pair(bf16_dirs[name], **kw)
    assert len(streamed.weights.row_blocks("model.embed_tokens.weight")) >= 5
    assert len(streamed.weights.row_blocks("model.layers.3.self_attn.q_proj.weight", tokens=1)) >= 8
    ids = np.array([PROMPT])
    caches = resident.new_cache(), streamed.new_cache()
    for x in (ids, ids[:, :1], ids[:, 1:2]):
        np.testing.assert_array_equal(streamed.forward(x, cache=caches[1]), resident.forward(x, cache=caches[0]))
    assert_streamed(streamed, forwards=3)


@pytest.mark.parametrize("case", ["qwen35moe-f32", "qwen3-h256-q8_0"])
def test_gguf_streamed_equals_resident(case):
    """GGUF tensors stay in the map: Q8_0 embedding rows and lm_head blocks are dequantised as read, stacked
    experts one expert at a time (float64 mode: the F32 tensors are converted too)."""
    path = Path(__file__).resolve().parents[1] / "fixtures" / "gguf" / f"{case}.gguf"
    resident, streamed = pair(path, dtype="float64")
    ids = np.array([[1, 2, 3, 4, 5, 6, 7]])
    cache = resident.new_cache(), streamed.new_cache()
    for x in (ids, np.array([[9]])):
        np.testing.assert_array_equal(streamed.forward(x, cache=cache[1]), resident.forward(x, cache=cache[0]))
    assert_streamed(streamed, forwards=2)
    assert streamed.weights.sha256() == resident.weights.sha256()


def test_streaming_bounds_the_converted_bytes_held(tmp_path, monkeypatch):
    """Peak traced allocations (numpy reports its buffers to tracemalloc) of a one-token forward: streamed under a
    budget of twice the largest piece, they stay below the budget plus the activations and the product kernel's
    working block; resident, they exceed
    the whole converted model."""
    cfg = {**PRESETS["tiny-qwen3"], "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
           "head_dim": 64, "tie_word_embeddings": False}
    rng = np.random.default_rng(0)
    arrays = random_weights(config_from_dict(cfg), seed=1)
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    write_safetensors(tmp_path / "model.safetensors", {k: v.astype(ml_dtypes.bfloat16) for k, v in arrays.items()})
    ids = rng.integers(0, 4096, (1, 1))
    monkeypatch.setattr(W, "ROW_BLOCK_BYTES", 2**20)   # lm_head in 4 blocks: the largest piece is 1 MiB
    monkeypatch.setattr(W, "VECTOR_BLOCK_BYTES", 2**20)
    peaks = {}
    for which, budget in (("resident", None), ("streamed", "2x")):
        model = refimpl.load(tmp_path)
        if budget:
            model = refimpl.load(tmp_path, max_resident_bytes=2 * model.weights.plan()[1])
        tracemalloc.start()
        model.forward(ids)
        peaks[which] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        peaks[which + " budget"] = model.weights.budget
        total = model.weights.converted_nbytes()
    # beyond the budget: the activations (< 1 MiB) and the product kernel's float64 block of the weight it
    # multiplies (kernels/products.py converts at most _IN_BLOCK elements of the second operand at once; one
    # token's products, _VECTOR_BLOCK elements in each thread's buffer, made once per thread)
    scratch = 8 * max(products._IN_BLOCK, products._VECTOR_BLOCK * products._cores())
    assert peaks["streamed"] <= peaks["streamed budget"] + 2**20 + scratch, peaks
    assert peaks["resident"] >= total, peaks
    assert total >= 8 * peaks["streamed budget"]


def test_budget_smaller_than_one_piece_is_refused(bf16_dirs, monkeypatch):
    smallest = refimpl.load(bf16_dirs["tiny-qwen3.5-moe"]).weights.plan()[1]
    with pytest.raises(WeightsError, match=r"model\.safetensors: the resident budget of .* is smaller than tensor "
                                           r"'.*', which needs .* converted at once; give at least"):
        refimpl.load(bf16_dirs["tiny-qwen3.5-moe"], max_resident_bytes=smallest - 1)
    monkeypatch.setattr(W, "ROW_BLOCK_BYTES", 2**20)
    monkeypatch.setattr(W, "VECTOR_BLOCK_BYTES", 2**20)
    model = refimpl.load(bf16_dirs["tiny-qwen3"], max_resident_bytes=2**20)
    with pytest.raises(WeightsError, match=r"tensor 'model.embed_tokens.weight' \(37.1 MiB converted\) does not fit"):
        model.weights["model.embed_tokens.weight"]   # whole: only its rows / row blocks fit


def test_default_residency_follows_half_of_memory(bf16_dirs, monkeypatch):
    model = refimpl.load(bf16_dirs["tiny-qwen3"])
    total = model.weights.converted_nbytes()
    assert model.weights.residency().startswith("resident")
    monkeypatch.setattr(W, "machine_memory", lambda: 2 * total - 2)
    monkeypatch.setattr(W, "DEFAULT_STREAM_BUDGET", 2**20)
    model = refimpl.load(bf16_dirs["tiny-qwen3"])
    assert not model.weights.resident and model.weights.budget == model.weights.plan()[1] > 2**20
    assert model.weights.residency().startswith("streamed per layer")
    assert math.isinf(refimpl.load("tiny-qwen3").weights.budget)   # float32 presets convert nothing


# ---------------------------------------------------------------------------------------------------- bad input

def _sharded(src, dst, header_edit=None):
    """The checkpoint in two shards with an index, as released checkpoints are; header_edit(header) may change
    the second shard's header."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    arrays = {k: np.array(v) for k, v in read_safetensors(src / "model.safetensors").items()}
    names = sorted(arrays)
    weight_map = {}
    for k, part in enumerate((names[:len(names) // 2], names[len(names) // 2:]), 1):
        f = dst / f"model-0000{k}-of-00002.safetensors"
        write_safetensors(f, {n: arrays[n] for n in part})
        weight_map.update({n: f.name for n in part})
    if header_edit is not None:
        f = dst / "model-00002-of-00002.safetensors"
        data = f.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        header_edit(header)
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        f.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def _f8(header):
    """One BF16 tensor re-declared as F8_E4M3 (one byte a value: the first half of its data)."""
    name = next(n for n, v in sorted(header.items()) if n != "__metadata__" and v["dtype"] == "BF16"
                and len(v["shape"]) == 2)
    begin, end = header[name]["data_offsets"]
    header[name].update(dtype="F8_E4M3", data_offsets=[begin, begin + (end - begin) // 2])


@pytest.mark.parametrize("damage,message", [
    ("missing shard", r"model-00002-of-00002\.safetensors: missing shard: model\.safetensors\.index\.json lists \d+ "
                      r"tensor\(s\) in it, e\.g\. 'model\.[\w.]+'"),
    ("truncated shard", r"model-00002-of-00002\.safetensors: truncated: tensor '[\w.]+' needs bytes"),
    ("unreadable dtype", r"model-00002-of-00002\.safetensors: tensor '[\w.]+' has dtype 'F8_E4M3', which refimpl "
                         r"cannot read"),
    ("integer weights", r"model-00002-of-00002\.safetensors: tensor '[\w.]+' has dtype int32, expected a float type"),
    ("budget below one tensor", r"model-0000\d-of-00002\.safetensors: the resident budget of 1 KiB is smaller than "
                                r"tensor '[\w.]+', which needs [\d.]+ [KM]iB converted at once"),
])
def test_bad_checkpoints_fail_in_one_line_naming_file_and_tensor(damage, message, bf16_dirs, tmp_path):
    def to_int32(header):
        name = next(n for n, v in sorted(header.items()) if n != "__metadata__" and len(v["shape"]) == 2)
        header[name]["dtype"] = "I32"
        begin, end = header[name]["data_offsets"]
        header[name]["shape"] = [(end - begin) // 4]
    d = _sharded(bf16_dirs["tiny-qwen3-moe"], tmp_path / "ckpt", {"unreadable dtype": _f8,
                                                                  "integer weights": to_int32}.get(damage))
    second = d / "model-00002-of-00002.safetensors"
    if damage == "missing shard":
        second.unlink()
    elif damage == "truncated shard":
        second.write_bytes(second.read_bytes()[:second.stat().st_size // 2])
    extra = ["--max-resident", "1KiB"] if damage.startswith("budget") else []
    if damage == "integer weights":   # a readable dtype at the wrong place: the shape check comes first otherwise
        message = message.replace("has dtype int32, expected a float type", "has (dtype int32|shape)")
    out = tmp_path / "bundle"
    run = subprocess.run([sys.executable, "-m", "refimpl.cli", "golden", "--model", str(d), "--input-ids", "1,2,3",
                          "--out", str(out), *extra], capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == "", (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refimpl: error: ") and re.search(message, lines[0]), lines
    assert not out.exists() and not list(tmp_path.glob("bundle*"))


def test_info_says_resident_or_streamed(bf16_dirs, capsys):
    assert main(["info", str(bf16_dirs["tiny-qwen3.5-moe"])]) == 0
    assert "weights      resident (" in capsys.readouterr().out
    assert main(["info", str(bf16_dirs["tiny-qwen3.5-moe"]), "--max-resident", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "weights      streamed per layer (" in out and "max_resident_bytes 64 MiB" in out


def test_forward_progress_is_per_layer_and_quiet_off_a_terminal(monkeypatch, capsys):
    """A long forward draws a per-layer bar (here: DELAY 0, as a task of an attached display); off a terminal,
    with nothing attached, it draws nothing."""
    class Display:   # records what a rich Progress is asked to draw
        def __init__(self):
            self.calls = []

        def add_task(self, description, total):
            self.calls.append(("add", description, total))
            return 7

        def update(self, task, completed):
            self.calls.append(("update", completed))

        def remove_task(self, task):
            self.calls.append(("remove", task))
    model = refimpl.load("tiny-qwen3-next")
    monkeypatch.setattr(progress, "DELAY", 0.0)
    with progress.attach(Display()) as display:
        model.forward(np.array([PROMPT]))
    assert display.calls[0] == ("add", "forward (4 layers)", 4)
    assert [c[1] for c in display.calls[1:-1]] == [1, 2, 3, 4] and display.calls[-1] == ("remove", 7)
    monkeypatch.setattr(progress, "_open", lambda *a: pytest.fail("a bar off a terminal"))
    model.forward(np.array([PROMPT]))
    assert capsys.readouterr().err == ""


def test_encodings_on_parts_streamed_equal_resident(bf16_dirs, tmp_path, monkeypatch):
    """An AIMET 1.0.0 encodings file with per-channel scales on a fused expert tensor and on lm_head, and per-block
    scales on the fused down_proj: each expert / row block takes its own rows' scales."""
    monkeypatch.setattr(W, "ROW_BLOCK_BYTES", 2**20)
    monkeypatch.setattr(W, "VECTOR_BLOCK_BYTES", 2**12)
    d = bf16_dirs["tiny-qwen3.5-moe"]
    w = refimpl.load(d).weights
    entries = []
    for name, kind in (("model.layers.0.mlp.experts.gate_up_proj", "PER_CHANNEL"), ("lm_head.weight", "PER_CHANNEL"),
                       ("model.layers.2.mlp.experts.down_proj", "PER_BLOCK")):
        a = np.asarray(w[name], np.float64)
        rows = a.reshape(-1, a.shape[-1])
        if kind == "PER_BLOCK":
            rows = rows.reshape(rows.shape[0], -1, 16)          # blocks of 16 along the input axis
        scale = (np.abs(rows).max(axis=-1) / 127).reshape(-1)
        entries.append({"name": name, "enc_type": kind, "bw": 8, "is_sym": True, "scale": scale.tolist(),
                        "offset": [-128] * scale.size, **({"block_size": 16} if kind == "PER_BLOCK" else {})})
    path = tmp_path / "enc.json"
    path.write_text(json.dumps({"version": "1.0.0", "param_encodings": entries}))
    resident, streamed = pair(d, precision=Policy("float32", "encodings", None, str(path)))
    ids = np.array([PROMPT])
    caches = resident.new_cache(), streamed.new_cache()
    for x in (ids, ids[:, :1]):
        np.testing.assert_array_equal(streamed.forward(x, cache=caches[1]), resident.forward(x, cache=caches[0]))
    assert_streamed(streamed, forwards=2)
    head = resident.weights["lm_head.weight"]
    assert not np.array_equal(head, w["lm_head.weight"])       # the encodings were applied


def test_streamed_layers_are_read_ahead(bf16_dirs, monkeypatch):
    """While layer i runs, the disk is asked for layer i + 1 (madvise WILLNEED on the map), and an MoE layer asks
    for the experts its router picked before converting the first of them; kept tensors are not asked for."""
    resident, streamed = pair(bf16_dirs["tiny-qwen3-moe"])
    asked = []
    monkeypatch.setattr(W, "will_need", lambda a: asked.append(a))
    calls = []
    prefetch = W.Weights.prefetch
    monkeypatch.setattr(W.Weights, "prefetch", lambda self, names: calls.append(list(names)) or
                        prefetch(self, calls[-1]))
    streamed.forward(np.array([PROMPT]))
    flat = [n if isinstance(n, str) else n[0] for c in calls for n in c]
    non_expert = {n for n in streamed.weights.stored if ".experts." not in n and n != "model.embed_tokens.weight"}
    assert non_expert <= set(flat)
    first_layer1 = next(k for k, c in enumerate(calls) if any(str(n).startswith("model.layers.1.") for n in c))
    assert any(".experts." in str(n) for c in calls[:first_layer1 + 1] for n in c) is False
    assert any(".layers.0.mlp.experts." in str(n) for c in calls[first_layer1 + 1:] for n in c)
    assert len(asked) == len(flat) and all(isinstance(a, np.memmap) or a.base is not None for a in asked)
    asked.clear()
    resident.forward(np.array([PROMPT]))
    resident.forward(np.array([PROMPT]))     # everything kept by now: nothing to ask the disk for
    n = len(asked)
    resident.forward(np.array([PROMPT]))
    assert len(asked) == n


@pytest.mark.parametrize("tokens", [1, 3])
def test_blocked_products_are_the_kernel_on_the_whole_matrix(tokens, monkeypatch):
    """Weights.linear, in 4 KiB row blocks for one token and lm_head's 1 MiB blocks, computes linear(x, W, b) of
    the whole matrix (bit for bit once each product is correctly rounded, refimpl/kernels/linear.py; here within
    float32 rounding of BLAS's own order), with its bias."""
    monkeypatch.setattr(W, "ROW_BLOCK_BYTES", 2**20)
    monkeypatch.setattr(W, "VECTOR_BLOCK_BYTES", 2**12)
    cfg = {**PRESETS["tiny-qwen3"], "attention_bias": True}
    arrays = {k: v.astype(np.float64) for k, v in random_weights(config_from_dict(cfg), 3).items()}  # converted
    model = refimpl.models.model.Model.from_arrays(config_from_dict(cfg), arrays, "test", refimpl.Policy())
    w = model.weights
    x = np.random.default_rng(0).standard_normal((1, tokens, 64), dtype=np.float32)
    for name, bias in (("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.bias"),
                       ("model.layers.1.mlp.down_proj.weight", None), ("model.embed_tokens.weight", None)):
        if name.endswith("down_proj.weight"):
            x_in = np.random.default_rng(1).standard_normal((1, tokens, 192), dtype=np.float32)
        else:
            x_in = x
        assert len(w.row_blocks(name, tokens)) > 1 or tokens > 1
        np.testing.assert_allclose(w.linear(x_in, name, bias), linear(x_in, w[name], None if bias is None
                                                                      else w[bias]), rtol=1e-6, atol=1e-6)
