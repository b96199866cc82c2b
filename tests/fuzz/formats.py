"""The formats the fuzzer mutates: per format the valid files it starts from (written by refimpl, or by
llama.cpp's converter: the committed GGUF fixtures), how a case's edits are chosen, and the target: the public
functions a user reaches the file through.

A case is a list of ops (tests/fuzz/mutate.py), the first ["base", name] saying which base files it copies.
A target reads the case with every public reader of the format and runs what a user runs next (a forward pass,
a diff); a refimpl error from one reader does not stop the others, but any other exception ends the case.
"""

import functools
import io
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np

from . import gguf_edit
from .mutate import apply, byte_op, fs_op, json_op, json_paths

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
IDS = np.array([[3, 17, 42, 100]])


class Format:
    """Base files in `root`/<base name>/; ops from a seed; the target."""
    name = ""
    edits = (1, 3)      # ops per case: uniform in this range
    contained = False   # whether reading a case must never open a file outside its directory

    def prepare(self, scratch: Path) -> None:
        self.root = scratch / f"base-{self.name}"
        if not self.root.exists():
            tmp = scratch / f".base-{self.name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            self.build(tmp)
            tmp.rename(self.root)
        (scratch / "outside").write_bytes(bytes(4096))
        self.bases = sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("_"))

    def build(self, root: Path) -> None:
        raise NotImplementedError

    def files(self, base: str) -> list[str]:
        d = self.root / base
        return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())

    def generate(self, seed: int) -> list:
        rng = random.Random(f"{self.name}/{seed}")
        base = rng.choice(self.bases)
        ops = [["base", base]]
        for _ in range(rng.randint(*self.edits)):
            ops.append(self.op(rng, base))
        return ops

    def op(self, rng: random.Random, base: str) -> list:
        raise NotImplementedError

    def materialise(self, case: Path, ops: list) -> None:
        shutil.copytree(self.root / ops[0][1], case, symlinks=True)
        for op in ops[1:]:
            apply(case, op)

    def target(self, case: Path, base: str) -> None:
        raise NotImplementedError

    # helpers
    def _json(self, base: str, rel: str):
        if not hasattr(self, "_docs"):
            self._docs = {}
        if (base, rel) not in self._docs:
            doc = json.loads((self.root / base / rel).read_text())
            self._docs[base, rel] = (doc, json_paths(doc))
        return self._docs[base, rel]


def _all(*steps) -> None:
    """Run every step; refimpl errors are collected and the first re-raised at the end (other exceptions end the
    case at once: they are what the fuzzer looks for)."""
    from refimpl.errors import RefimplError
    first = None
    for step in steps:
        try:
            step()
        except RefimplError as e:
            first = first or e
    if first is not None:
        raise first


# ---------------------------------------------------------------------------------------------------- GGUF

class GGUF(Format):
    name = "gguf"

    def build(self, root: Path) -> None:
        import refimpl
        from refimpl.formats.gguf import tokenizer_metadata, write_gguf
        for name in ("qwen35-f32", "qwen3moe-f32", "semantics-qwen35moe-mrope321-q4_0", "qwen3-every-type"):
            (root / name).mkdir()
            shutil.copy(FIXTURES / f"{name}.gguf", root / name / "model.gguf")
        # refimpl's writer: Q8_0 blocks, a vocabulary, Qwen3-Next's split projections
        (root / "refimpl-qwen3next-q8_0").mkdir()
        write_gguf(root / "refimpl-qwen3next-q8_0" / "model.gguf", refimpl.load(FIXTURES / "qwen3next-f32.gguf"),
                   "Q8_0", tokenizer=tokenizer_metadata(FIXTURES / "qwen35-f32.gguf"))

    def op(self, rng, base):
        data = (self.root / base / "model.gguf").read_bytes()
        r = rng.random()
        if r < 0.7:
            return ["gguf", "model.gguf", gguf_edit.choose(rng, data)]
        if r < 0.97:
            return byte_op(rng, "model.gguf", len(data))
        return fs_op(rng, "model.gguf", ["model.gguf"])

    def target(self, case, base):
        import refimpl
        from refimpl.errors import WeightsError
        from refimpl.formats.gguf import GGUFFile, tokenizer_metadata
        from refimpl.sources import load_tokenizer
        path = case / "model.gguf"
        holder = {}

        def header():
            holder["g"] = g = GGUFFile(path)
            g.storage()
            for name in list(g.tensors)[:64]:
                try:
                    g.array(name)
                except WeightsError:
                    pass

        def model():
            refimpl.load(path).forward(IDS)

        def tokenizer():
            g = holder.get("g")
            if g is not None and "tokenizer.ggml.model" in g.metadata:
                tokenizer_metadata(g)
                tok = load_tokenizer(path)
                tok.decode(tok.encode("Hello world, it's 2026!"))
        _all(header, model, tokenizer)


# ---------------------------------------------------------------------------------------------------- HF directories

def _hf_dir(d: Path, case: str = "qwen35", shards: int = 2) -> None:
    """An HF checkpoint directory of a tiny case, its tensors split over `shards` files with an index."""
    from gguf_cases import CASES, tokenizer_json, weights
    from refimpl.formats.safetensors import write_safetensors
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(CASES[case], indent=1))
    w = weights(case)
    names = sorted(w)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        f = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(d / f, {n: w[n] for n in part})
        weight_map.update({n: f for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": sum(
        a.nbytes for a in w.values())}, "weight_map": weight_map}, indent=1))
    (d / "tokenizer.json").write_text(tokenizer_json())


class Safetensors(Format):
    """Shards and their index (the config kept valid: Config mutates that)."""
    name = "safetensors"

    def build(self, root):
        _hf_dir(root / "qwen35")
        _hf_dir(root / "qwen3moe", "qwen3moe")

    def op(self, rng, base):
        files = [f for f in self.files(base) if f.endswith(".safetensors")]
        r = rng.random()
        if r < 0.15:
            doc, paths = self._json(base, "model.safetensors.index.json")
            return json_op(rng, "model.safetensors.index.json", doc, paths)
        f = rng.choice(files)
        if r < 0.6:
            import struct
            data = (self.root / base / f).read_bytes()
            (n,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8:8 + n])
            return json_op(rng, f, header, json_paths(header), kind="st")
        if r < 0.93:
            return byte_op(rng, f, (self.root / base / f).stat().st_size)
        return fs_op(rng, rng.choice(files + ["model.safetensors.index.json"]), files)

    def target(self, case, base):
        import refimpl
        from refimpl.formats.safetensors import read_safetensors

        def shards():
            for f in sorted(case.glob("*.safetensors")):
                _all(lambda f=f: read_safetensors(f), lambda f=f: read_safetensors(f, {}))
        _all(shards, lambda: refimpl.load(case).forward(IDS))


class Config(Format):
    """config.json of an HF directory: types, values, counts."""
    name = "config.json"

    def build(self, root):
        for case in ("qwen35", "qwen3moe", "qwen3next", "qwen3"):
            _hf_dir(root / case, case, shards=1)

    def op(self, rng, base):
        doc, paths = self._json(base, "config.json")
        if rng.random() < 0.9:
            return json_op(rng, "config.json", doc, paths)
        if rng.random() < 0.5:
            return byte_op(rng, "config.json", len(json.dumps(doc, indent=1)))
        return fs_op(rng, "config.json", ["tokenizer.json"])

    def target(self, case, base):
        import refimpl
        from refimpl.models.config import load_config
        _all(lambda: load_config(case), lambda: refimpl.load(case).forward(IDS))


# ---------------------------------------------------------------------------------------------------- bundles, dumps

def _golden(root: Path) -> tuple[Path, Path]:
    """The shared model directory and a genie bundle of it (every tap, all exports, 3 steps)."""
    import refimpl
    from refimpl.golden import write_golden
    model_dir = root / "_model"
    if not model_dir.exists():
        _hf_dir(model_dir, shards=1)
    bundle = root / "_bundle"
    if not bundle.exists():
        model = refimpl.load(model_dir)
        write_golden(bundle, model, [3, 17, 42, 100, 250, 7], source=str(model_dir), convention="genie",
                     params={"ar": 4, "cl": 16}, decode_steps=1, exports=("safetensors", "npz"), aimet=True)
    return model_dir, bundle


def _check_bundle(path: Path, model_dir: Path, same: Path):
    """Every public reading of a bundle: opening (verified and not), every tensor, the input list, hashes; a diff
    against `same` (the unmutated bundle as the device's dump), an explain and a replay of layer 0."""
    from rich.console import Console

    import refimpl
    from refimpl.bundle import read_bundle, valid_mask
    from refimpl.diff import compare
    from refimpl.diff.dump import read_dump
    from refimpl.diff.explain import explain
    from refimpl.diff.replay import replay
    from refimpl.diff.report import print_report

    def verified():
        b = read_bundle(path)
        b.input_list()
        for rec in b.records():
            b.tensor(rec["step"], rec["role"], rec["name"])
            valid_mask(rec["shape"], rec.get("valid"))
        b.verify()

    def lazy():
        b = read_bundle(path, verify=False)
        for rec in b.records():
            np.asarray(b.tensor(rec["step"], rec["role"], rec["name"])).sum()

    def diff():
        b = read_bundle(path, verify=False)
        report = compare(b, read_dump(same, b, dtype="native"))
        print_report(report, Console(file=io.StringIO(), width=120))

    def model_steps():
        b = read_bundle(path, verify=False)
        model = refimpl.load(model_dir)
        tap = next((r for r in b.records() if r["role"] == "tap" and r["shape"] and 0 not in r["shape"]), None)
        if tap is not None:
            explain(b, model, f"{tap['name']}[{','.join(['0'] * len(tap['shape']))}]", step=tap["step"])
        d = read_dump(same, b, dtype="native")
        replay(b, d, model, layer=0, step=0)
    _all(verified, lazy, diff, model_steps)


class Bundle(Format):
    name = "bundle"
    contained = True

    def build(self, root):
        model_dir, bundle = _golden(root)
        shutil.copytree(bundle, root / "genie" / "bundle")

    def op(self, rng, base):
        files = [f for f in self.files(base) if f.startswith("bundle/")]
        raws = [f for f in files if f.endswith(".raw")]
        r = rng.random()
        if r < 0.55:
            doc, paths = self._json(base, "bundle/manifest.json")
            fields = ("file", "shape", "dtype", "valid", "axes", "step", "role", "name", "sha256", "size")
            return json_op(rng, "bundle/manifest.json", doc, paths, prefer=lambda p: (
                len(p) >= 2 and p[0] in ("tensors", "derived", "steps") or p and p[-1] in fields))
        if r < 0.65:
            text = (self.root / base / "bundle/input_list.txt").read_text()
            lines = text.splitlines()
            k = rng.randrange(len(lines))
            edit = rng.choice(["../../outside", "/etc/passwd", "x:=", ":=y", "\udcff", "a:=b:=c", "", " " * 3,
                               lines[k] * 2, "input_ids:=steps/0/inputs/../../../outside"])
            lines[k] = edit if rng.random() < 0.5 else lines[k] + " " + edit
            return ["write", "bundle/input_list.txt", "\n".join(lines).encode("utf-8", "surrogateescape").hex()]
        if r < 0.85:
            f = rng.choice(raws + ["bundle/manifest.json", "bundle/input_list.txt"])
            return byte_op(rng, f, (self.root / base / f).stat().st_size)
        return fs_op(rng, rng.choice(files), files)

    def target(self, case, base):
        _check_bundle(case / "bundle", self.root / "_model", self.root / "_bundle")


class Dump(Format):
    """Device dumps of the bundle: a qnn-net-run directory, .npz, .safetensors, a directory of .npy."""
    name = "dump"
    contained = True

    def build(self, root):
        from refimpl.bundle import read_bundle
        from refimpl.formats.safetensors import write_safetensors
        model_dir, bundle = _golden(root)
        b = read_bundle(bundle)
        arrays = {f"{r['step']}/{r['role']}/{r['name']}": np.asarray(b.tensor(r["step"], r["role"], r["name"]))
                  for r in b.records() if r["role"] != "input"}
        q = root / "qnn" / "dump"
        for key, a in arrays.items():
            k, _, name = key.split("/")
            f = q / f"Result_{k}" / f"{name}.raw"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(np.ascontiguousarray(a, np.float32).tobytes())
        (root / "npz").mkdir()
        np.savez(root / "npz" / "dump.npz", **{k: a.view(np.uint16) if a.dtype.name == "bfloat16" else a
                                               for k, a in arrays.items()})
        (root / "safetensors").mkdir()
        write_safetensors(root / "safetensors" / "dump.safetensors", arrays)
        for key, a in arrays.items():
            f = root / "npy" / "dump" / "steps" / key.split("/")[0] / (key.split("/")[1] + "s") / \
                f"{key.split('/')[2]}.npy"
            f.parent.mkdir(parents=True, exist_ok=True)
            np.save(f, a)

    def op(self, rng, base):
        files = self.files(base)
        f = rng.choice(files)
        size = (self.root / base / f).stat().st_size
        r = rng.random()
        if f.endswith(".npy") and r < 0.4:
            shape = rng.choice(["(2**40,)", "(1099511627776,)", "(-1,)", "(4, 64)", "()", "(0,)", "(3,3,3,3,3,3)",
                                "[1]", "(1e3,)", "(2**62, 2**62)", "'x'", "(1,"])
            descr = rng.choice(["'<f4'", "'<f8'", "'|O'", "'<U8'", "'V8'", "'>f4'", "[('a','<f4')]", "'<c8'",
                                "'<m8'", "'foo'", "1"])
            text = rng.choice([f"{{'descr': {descr}, 'fortran_order': False, 'shape': {shape}, }}",
                               f"{{'descr': '<f4', 'fortran_order': {rng.choice(['True', '1', 'None'])}, "
                               f"'shape': {shape}, }}", "{", "{'descr': '<f4'}", "{'a': (((((((((((", "\x00\x01"])
            return ["npy", f, text]
        if f.endswith(".safetensors") and r < 0.5:
            import struct
            data = (self.root / base / f).read_bytes()
            (n,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8:8 + n])
            return json_op(rng, f, header, json_paths(header), kind="st")
        if f.endswith(".npz") and r < 0.5:
            return ["npz", f, rng.randrange(64), rng.choice(
                ["{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }",
                 "{'descr': '<f4', 'fortran_order': False, 'shape': (2**62, 4), }",
                 "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
                 "{'descr': '<f4', 'fortran_order': False, 'shape': (3, ", "{'descr':"])]
        if r < 0.9:
            return byte_op(rng, f, size)
        op = fs_op(rng, f, files)
        if op[0] == "symlink" and op[2] == "outside" and "/" not in f:
            op[2] = "/dev/zero"   # a single-file dump is the user's own path: a link out of it is theirs to make
        return op

    def materialise(self, case, ops):
        super().materialise(case, [ops[0]] + [o for o in ops[1:] if o[0] != "npz"])
        for op in ops[1:]:
            if op[0] == "npz":
                _npz_member_header(case / op[1], op[2], op[3])

    def target(self, case, base):
        from refimpl.bundle import read_bundle
        from refimpl.diff import compare
        from refimpl.diff.dump import read_dump
        dump = case / {"npz": "dump.npz", "safetensors": "dump.safetensors"}.get(base, "dump")
        bundle = read_bundle(self.root / "_bundle", verify=False)
        compare(bundle, read_dump(dump, bundle))


def _npz_member_header(path: Path, index: int, header: str) -> None:
    """Member `index` of an .npz rewritten with the given .npy header (its data kept)."""
    import zipfile
    if not path.is_file() or path.is_symlink():
        return
    try:
        with zipfile.ZipFile(path) as z:
            members = [(i, z.read(i)) for i in z.infolist()]
    except (zipfile.BadZipFile, OSError, EOFError):
        return
    i = index % len(members)
    info, data = members[i]
    h = header.encode("latin1")
    h += b" " * (-(10 + len(h) + 1) % 64) + b"\n"
    import struct
    hlen = struct.unpack("<H", data[8:10])[0] if len(data) >= 10 else 0
    members[i] = (info, b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + data[10 + hlen:])
    with zipfile.ZipFile(path, "w") as z:
        for info, data in members:
            z.writestr(info, data)


# ---------------------------------------------------------------------------------------------------- encodings

def _encodings(root: Path) -> None:
    """Encodings files of the qwen3 case in both AIMET schemas: per-tensor, per-channel, per-block, LPBQ and float
    parameters; activations at module inputs and outputs (legacy) or tensor names (1.0.0)."""
    import refimpl
    model_dir = root.parent / "dataset-model"    # beside the bases: its path is in the manifest, and a base is
    if not model_dir.exists():                   # built under a temporary name
        _hf_dir(root.parent / ".dataset-model.tmp", "qwen3", shards=1)
        (root.parent / ".dataset-model.tmp").rename(model_dir)
    model = refimpl.load(model_dir)
    w = model.weights
    with refimpl.trace() as tr:
        model.forward(IDS)

    def per_channel(a, bw=8):
        s = (np.abs(a).max(1) / (2 ** (bw - 1) - 1)).astype(np.float32)
        return [{"bitwidth": bw, "dtype": "int", "is_symmetric": "True", "scale": float(x), "offset": -2 ** (bw - 1),
                 "min": float(-x * 2 ** (bw - 1)), "max": float(x * (2 ** (bw - 1) - 1))} for x in s]

    def act(name, bw=16):
        a = np.asarray(tr[name])
        lo, hi = float(min(a.min(), 0)), float(max(a.max(), 0))
        scale = (hi - lo) / (2 ** bw - 1) or 1.0
        return {"bitwidth": bw, "dtype": "int", "is_symmetric": "False", "scale": scale, "offset": round(lo / scale),
                "min": lo, "max": hi}
    L0 = "model.layers.0"
    params = {f"{L0}.mlp.down_proj.weight": per_channel(w[f"{L0}.mlp.down_proj.weight"], 4),
              f"{L0}.self_attn.q_proj.weight": per_channel(w[f"{L0}.self_attn.q_proj.weight"])[:1],
              f"{L0}.mlp.up_proj.weight": [{"bitwidth": 16, "dtype": "float"}]}
    acts = {m: {"output": {"0": act(m)}} for m in list(model.modules)[:12]}
    acts[f"{L0}.self_attn.q_proj"] = {"input": {"0": act(f"{L0}.input_layernorm", 8)}}
    (root / "legacy").mkdir()
    (root / "legacy" / "model.encodings").write_text(json.dumps({"activation_encodings": acts,
                                                                 "param_encodings": params}, indent=1))
    a, b = f"{L0}.self_attn.o_proj.weight", f"{L0}.mlp.gate_proj.weight"
    wa, wb = np.asarray(w[a]), np.asarray(w[b])
    block = 32
    blocks = wa.shape[1] // block
    sa = np.stack([np.abs(wa[:, i * block:(i + 1) * block]).max(1) / 127 for i in range(blocks)], 1)
    ch = np.abs(wb).max(1) / 14
    v1_params = [
        {"name": a, "dtype": "INT", "enc_type": "PER_BLOCK", "bw": 8, "is_sym": True, "block_size": block,
         "scale": sa.reshape(-1).astype(np.float32).tolist(), "offset": [-128] * sa.size},
        {"name": b, "dtype": "INT", "enc_type": "LPBQ", "bw": 8, "compressed_bw": 4, "is_sym": True,
         "block_size": 32, "scale": ch.astype(np.float32).tolist(), "offset": [-128] * len(ch),
         "per_block_int_scale": np.tile([1, 2], (wb.shape[0], wb.shape[1] // 64)).reshape(-1).tolist()},
        {"name": f"{L0}.self_attn.k_proj.weight", "dtype": "INT", "enc_type": "PER_TENSOR", "bw": 8, "is_sym": False,
         "scale": [0.01], "offset": [-128]},
        {"name": f"{L0}.mlp.up_proj.weight", "dtype": "FLOAT", "enc_type": "PER_TENSOR", "bw": 16, "scale": [],
         "offset": []}]
    v1_acts = [{"name": "/model/layers.0/self_attn/q_proj/MatMul_output_0", "dtype": "INT",
                "enc_type": "PER_TENSOR", "bw": 16, "is_sym": False, "scale": [act(f"{L0}.self_attn.q_proj")["scale"]],
                "offset": [act(f"{L0}.self_attn.q_proj")["offset"]]},
               {"name": "model.norm", "dtype": "FLOAT", "enc_type": "PER_TENSOR", "bw": 16, "scale": [], "offset": []}]
    (root / "v1").mkdir()
    (root / "v1" / "model.encodings").write_text(json.dumps({"version": "1.0.0", "activation_encodings": v1_acts,
                                                             "param_encodings": v1_params}, indent=1))


class Encodings(Format):
    name = "encodings"

    def build(self, root):
        _encodings(root)

    def op(self, rng, base):
        doc, paths = self._json(base, "model.encodings")
        r = rng.random()
        if r < 0.88:
            keys = ("scale", "offset", "bitwidth", "bw", "block_size", "enc_type", "dtype", "name", "is_sym",
                    "is_symmetric", "per_block_int_scale", "compressed_bw", "exponent_bits", "input", "output")
            return json_op(rng, "model.encodings", doc, paths, prefer=lambda p: bool(p) and p[-1] in keys or (
                len(p) >= 2 and isinstance(p[-2], str) and p[-2] in ("scale", "offset")))
        if r < 0.97:
            return byte_op(rng, "model.encodings", (self.root / base / "model.encodings").stat().st_size)
        return fs_op(rng, "model.encodings", ["model.encodings"])

    def target(self, case, base):
        import refimpl
        from refimpl.encodings import read_activation_encodings, read_encodings
        from refimpl.precision import Policy
        path = case / "model.encodings"
        model_dir = self.root / "_model"
        _all(lambda: read_encodings(path), lambda: read_activation_encodings(path),
             lambda: refimpl.load(model_dir, precision=Policy(weights="encodings", encodings=str(path))).forward(IDS),
             lambda: refimpl.load(model_dir, precision=Policy(weights="encodings", encodings=str(path),
                                                              strict_encodings=True)))


# ---------------------------------------------------------------------------------------------------- diff inputs

class DiffInputs(Format):
    """What `refimpl diff` reads besides the bundle and dump: --policy, --mapping and --rejudge's metrics JSON."""
    name = "policy"

    def build(self, root):
        from refimpl.bundle import read_bundle
        from refimpl.diff import compare, make_policy, save_metrics
        from refimpl.diff.dump import read_dump
        _, bundle = _golden(root)
        b = read_bundle(bundle)
        names = [r["name"] for r in b.records()]
        policy = {"dtype": "float16", "three_way_k": 3,
                  "tensors": [{"match": r"mlp\.down_proj$", "max_nmse": 1e-4, "min_cosine": 0.999},
                              {"match": "logits", "max_kl_over_lnv_max": 0.01, "atol": 1e-3},
                              {"match": "input_ids", "exact": True},
                              {"match": r"attn_residual$", "code_shift": {"max_share": 0.6}},
                              {"match": r"mlp\.up_proj$", "code_shift": False}],
                  "layouts": {"past_key_.*_out": "transposed", "^nothing$": "aimet"}, "ignore": ["attn_probs$"]}
        mapping = {n: n.replace(".", "_") for n in names[:40]}
        for case in ("policy", "mapping", "metrics"):
            (root / case).mkdir()
        (root / "policy" / "policy.json").write_text(json.dumps(policy, indent=1))
        (root / "mapping" / "mapping.json").write_text(json.dumps(mapping, indent=1))
        report = compare(b, read_dump(bundle, b, dtype="native"), make_policy(policy))
        r = next(r for r in report.results if r.metrics and not r.metrics.get("integer"))
        r.reference = {k: v for k, v in r.metrics.items() if k != "channels"}   # three-way: code_shift judged
        r.metrics["code_shift"] = {"codes": 1, "share": 0.9, "n": 100, "zero_point": -32768, "scale": 1e-3}
        save_metrics(report, root / "metrics" / "metrics.json")

    def op(self, rng, base):
        rel = {"policy": "policy.json", "mapping": "mapping.json", "metrics": "metrics.json"}[base]
        doc, paths = self._json(base, rel)
        r = rng.random()
        if r < 0.85:
            return json_op(rng, rel, doc, paths)
        if r < 0.97:
            return byte_op(rng, rel, (self.root / base / rel).stat().st_size)
        return fs_op(rng, rel, [rel])

    def target(self, case, base):
        from rich.console import Console

        from refimpl.bundle import read_bundle
        from refimpl.diff import compare, load_metrics, load_policy, rejudge
        from refimpl.diff.dump import read_dump, read_mapping
        from refimpl.diff.report import print_report
        bundle_path = self.root / "_bundle"
        b = read_bundle(bundle_path, verify=False)
        if base == "policy":
            def run():
                policy = load_policy(case / "policy.json")
                compare(b, read_dump(bundle_path, b, dtype="native"), policy)
                rejudge(load_metrics(self.root / "metrics" / "metrics.json"), policy)
            _all(run)
        elif base == "mapping":
            _all(lambda: compare(b, read_dump(bundle_path, b, mapping=read_mapping(case / "mapping.json"),
                                              dtype="native")))
        else:
            def run():
                report = rejudge(load_metrics(case / "metrics.json"), load_policy(None, "float16"))
                print_report(report, Console(file=io.StringIO(), width=100))
            _all(run)




# ---------------------------------------------------------------------------------------------------- CLI arguments

# a valid command line of every subcommand (paths relative to the case directory, which is the working directory)
_COMMANDS = [
    ["info", "model"],
    ["run", "model", "--input-ids", "3,17,42", "--top", "3"],
    ["convert", "model", "--out", "m.gguf", "--type", "q8_0"],
    ["golden", "--model", "model", "--input-ids", "3,17,42,100", "--convention", "genie", "--ar", "4", "--cl", "16",
     "--taps", r"layers\.0\.mlp", "--out", "g", "-q"],
    ["golden", "--model", "model", "--input-ids", "3,17", "--convention", "qeff", "--ar", "4", "--cl", "16",
     "--no-taps", "--export", "npz", "--out", "g", "-q"],
    ["generate", "--model", "model", "--input-ids", "3,17", "--max-new-tokens", "2", "--ids"],
    ["diff", "bundle", "bundle", "--top", "3", "-q", "--json", "m.json", "--policy", "policy.json"],
    ["diff", "bundle", "--rejudge", "metrics.json", "--dtype", "fp16"],
    ["replay", "bundle", "bundle", "--layer", "0", "--step", "0", "--mapping", "mapping.json", "--model", "model"],
    ["explain", "bundle", "logits[0,0,0]", "--step", "0", "--model", "model"],
    ["reference", "--model", "model", "--text", "text.txt", "--ctx", "8", "--out", "r", "-q"],
    ["compare-logits", "reference", "reference", "--policy", "max_mean_kld=0.01", "-q"],
    ["export-kld-base", "reference", "out.kld"],
]
# values a user might mistype: invalid numbers, bad regexes, and files that must be refused without reading them
# forever (a FIFO, /dev/zero behind a link, JSON nested 100,000 deep); never an absolute path or '..' (the case
# directory is the only place a command may write)
_CLI_VALUES = ["nan", "inf", "-inf", "-1", "0", "-0", "1e999", "0x10", "", " ", "[", "(?", "a{99999999999}", "x" * 5000,
               "1,,2", "3,-1", "3,x", "fifo", "zero", "deep.json", "bad.json", "list.json", "missing/file", "model",
               "bundle", "reference", "text.txt", "=", "=aimet", "x=sideways", "\u00e9\u0000", "--", "-q"]


class CLI(Format):
    """Command lines of every subcommand, mutated: values replaced, tokens dropped, doubled or swapped, flags
    added; run as `refimpl` runs them. Exit 0 / 1: ok; exit 2 with one `refimpl: error:` line: clean; anything else
    (exit 3, a traceback, several lines): crash."""
    name = "cli"
    edits = (1, 2)

    def build(self, root):
        from refimpl.cli import main
        model_dir, bundle = _golden(root)
        base = root / "cli"
        base.mkdir()
        shutil.copytree(model_dir, base / "model")
        shutil.copytree(bundle, base / "bundle")
        (base / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
        (base / "bad.json").write_text('{"tensors": [')
        (base / "list.json").write_text("[1, 2]")
        (base / "text.txt").write_text("Hello world, it's 2026! " * 6)
        (base / "policy.json").write_text(json.dumps({"dtype": "float16", "tensors": [{"match": "logits",
                                                                                       "max_nmse": 1e-3}]}))
        (base / "mapping.json").write_text(json.dumps({"logits": "output_0"}))
        quiet = io.StringIO()
        import contextlib
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            assert main(["diff", str(base / "bundle"), str(base / "bundle"), "-q", "--json",
                         str(base / "metrics.json")]) == 0
            assert main(["reference", "--model", str(base / "model"), "--text", str(base / "text.txt"), "--ctx", "8",
                         "--out", str(base / "reference"), "-q"]) == 0

    def generate(self, seed):
        rng = random.Random(f"{self.name}/{seed}")
        argv = list(rng.choice(_COMMANDS))
        for _ in range(rng.randint(*self.edits)):
            kind = rng.choice(["value", "value", "value", "drop", "double", "swap", "flag"])
            if len(argv) < 2:   # the subcommand alone: give it something
                kind = "flag"
            i, j = rng.randrange(1, max(2, len(argv))), rng.randrange(1, max(2, len(argv)))
            if kind == "value":
                argv[i] = rng.choice(_CLI_VALUES)
            elif kind == "drop":
                del argv[i]
            elif kind == "double":
                argv.insert(i, argv[i])
            elif kind == "swap":
                argv[i], argv[j] = argv[j], argv[i]
            else:
                argv += [rng.choice(self._flags(argv[0])), rng.choice(_CLI_VALUES)]
        return [["base", "cli"], ["argv", argv]]

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def _flags(command: str) -> list[str]:
        """The options of a subcommand, but never --overwrite (the base files are shared between cases)."""
        from refimpl.cli import build_parser
        sub = next(a for a in build_parser()._actions if a.dest == "command")
        parser = sub.choices.get(command) or sub.choices["info"]
        return [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--overwrite"]

    def materialise(self, case, ops):
        shutil.copytree(self.root / "cli", case, symlinks=True)
        os.mkfifo(case / "fifo")
        (case / "zero").symlink_to("/dev/zero")
        (case / "argv.json").write_text(json.dumps(ops[1][1]))

    def target(self, case, base):
        import contextlib

        from refimpl.cli import main
        from refimpl.errors import InputError
        argv = json.loads((case / "argv.json").read_text())
        out, err = io.StringIO(), io.StringIO()
        cwd = os.getcwd()
        os.chdir(case)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(argv)
                except SystemExit as e:   # argparse: --help (0), a usage error (2)
                    code = e.code
        finally:
            os.chdir(cwd)
        lines = err.getvalue().splitlines()
        errors = [line for line in lines if not line.startswith(("refimpl: note:", "refimpl: warning:"))]
        if code in (0, 1, None):   # done (a diff's mismatch: 1); generate reports its speed on stderr
            return
        if code == 2 and len(errors) == 1 and errors[0].startswith("refimpl: error: "):
            raise InputError(errors[0][len("refimpl: error: "):][:MAX_CLI_MESSAGE])
        text = " | ".join(errors)
        internal = text.partition("internal error: ")[2].partition(";")[0]
        raise CLIFailure(f"exit {code}: {text[:300]}", f"exit {code}: {internal or text[:60]} ({argv[0]})")


MAX_CLI_MESSAGE = 900


class CLIFailure(Exception):
    """A command line that ended otherwise than ok or with one `refimpl: error:` line (exit 2); `signature` groups
    failures alike (the internal error's type and place, which main() prints)."""

    def __init__(self, message: str, signature: str):
        super().__init__(message)
        self.signature = signature



# ---------------------------------------------------------------------------------------------- dataset references

class SilentAcceptance(Exception):
    """A damaged file read without error to other numbers than the undamaged one gives (or, resumed, to other
    files): what validation must refuse."""

    def __init__(self, message: str, signature: str):
        super().__init__(message)
        self.signature = signature


def _dataset(root: Path) -> dict:
    """A finished reference of the tiny qwen3 case (3 windows of 16 tokens, top-4), a device's logits of it and
    what reading them gives: the shared parts of both dataset formats (in root/_*, not a base)."""
    import refimpl
    from refimpl.dataset import compare_logits, cut, open_reference, write_kld_base, write_reference
    from refimpl.dataset.reference import Job, window_logits
    from refimpl.precision import Policy
    model_dir = root.parent / "dataset-model"    # beside the bases: its path is in the manifest, and a base is
    if not model_dir.exists():                   # built under a temporary name
        _hf_dir(root.parent / ".dataset-model.tmp", "qwen3", shards=1)
        (root.parent / ".dataset-model.tmp").rename(model_dir)
    model = refimpl.load(model_dir)
    ids = np.random.default_rng(28).integers(0, 300, 48).tolist()
    windows = cut([ids], 16)
    job = Job(str(model_dir), Policy(), first=windows.first, scored=windows.scored, top_k=4)
    write_reference(root / "_full", job, windows, {"stride": None}, model=model)
    noise = np.random.default_rng(1)
    np.savez(root / "_device.npz", **{f"{k}/logits": (window_logits(model, t) + 0.3 * noise.standard_normal(
        (16, 320))).astype(np.float32) for k, t in enumerate(windows.tokens)})
    write_kld_base(open_reference(root / "_full"), root / "_full.kld")
    expected = {"report": _dataset_numbers(compare_logits(open_reference(root / "_full"), root / "_device.npz")),
                "kld": (root / "_full.kld").read_bytes().hex()}
    (root / "_expected.json").write_text(json.dumps(expected, sort_keys=True))
    (root / "_full.kld").unlink()
    return expected


def _dataset_numbers(report: dict) -> str:
    """A report's numbers (not the paths, model name and drill-down commands the manifest's text fields make)."""
    drop = ("reference", "device", "model", "worst_positions", "notes")
    return json.dumps({k: v for k, v in report.items() if k not in drop}, sort_keys=True, default=str)


def _dataset_op(fmt: Format, rng: random.Random, base: str) -> list:
    files = fmt.files(base)
    f = rng.choice(files)
    size = (fmt.root / base / f).stat().st_size
    r = rng.random()
    if f.endswith("manifest.json") and r < 0.6:
        doc, paths = fmt._json(base, f)
        return json_op(rng, f, doc, paths, prefer=lambda p: 3 if p and p[0] in ("windows", "vocab_size", "top_k",
                                                                                "format", "version") else 1)
    if f.endswith(".safetensors") and r < 0.45:
        import struct
        data = (fmt.root / base / f).read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        return json_op(rng, f, header, json_paths(header), kind="st")
    if r < 0.92:
        return byte_op(rng, f, size)
    return fs_op(rng, f, files)


class DatasetReference(Format):
    """A finished dataset reference (manifest.json, tokens.safetensors, windows/*.safetensors) read as
    compare-logits and export-kld-base read it: every case either fails with a refimpl error or gives exactly
    the numbers (and the base file) of the undamaged reference."""
    name = "dataset-reference"

    def build(self, root):
        _dataset(root)
        shutil.copytree(root / "_full", root / "full" / "ref")

    def op(self, rng, base):
        return _dataset_op(self, rng, base)

    def target(self, case, base):
        from refimpl.dataset import compare_logits, open_reference, write_kld_base
        expected = json.loads((self.root / "_expected.json").read_text())

        def compare():
            got = _dataset_numbers(compare_logits(open_reference(case / "ref"), self.root / "_device.npz"))
            if got != expected["report"]:
                raise SilentAcceptance("compare-logits read a damaged reference to other numbers",
                                       "silent acceptance (compare-logits)")

        def export():
            write_kld_base(open_reference(case / "ref"), case / "out.kld")
            if (case / "out.kld").read_bytes().hex() != expected["kld"]:
                raise SilentAcceptance("export-kld-base wrote another base file from a damaged reference",
                                       "silent acceptance (export-kld-base)")
        _all(compare, export)


class DatasetResume(Format):
    """The state a stopped `refimpl reference` leaves (manifest, tokens, the first window of three), resumed:
    every case either fails with a refimpl error or ends with the files of the uninterrupted run."""
    name = "dataset-resume"

    def build(self, root):
        _dataset(root)
        shutil.copytree(root / "_full", root / "partial" / "ref")
        for f in ("windows/000001.safetensors", "windows/000002.safetensors", "summary.json"):
            (root / "partial" / "ref" / f).unlink()

    def op(self, rng, base):
        return _dataset_op(self, rng, base)

    @functools.cached_property
    def _run(self):
        import refimpl
        from refimpl.dataset import cut
        from refimpl.dataset.reference import Job
        from refimpl.precision import Policy
        manifest = json.loads((self.root / "_full" / "manifest.json").read_text())
        ids = np.random.default_rng(28).integers(0, 300, 48).tolist()
        windows = cut([ids], 16)
        job = Job(manifest["model"]["source"], Policy(), first=windows.first, scored=windows.scored, top_k=4)
        return job, windows, refimpl.load(manifest["model"]["source"])

    def target(self, case, base):
        from refimpl.dataset import write_reference
        job, windows, model = self._run
        write_reference(case / "ref", job, windows, {"stride": None}, model=model)
        full = self.root / "_full"
        for f in sorted(p.relative_to(full) for p in full.rglob("*") if p.is_file()):
            got, want = case / "ref" / f, full / f
            if f.suffix == ".json" and got.is_file():   # the same document (a mutation of its spacing is no damage)
                same = json.loads(got.read_bytes()) == json.loads(want.read_bytes())
            else:
                same = got.is_file() and got.read_bytes() == want.read_bytes()
            if not same:
                raise SilentAcceptance(f"the resumed run ended with another {f}", f"silent acceptance ({f.name})")


from .onnx_quantisers import AimetOnnxEncodings, QDQModel  # noqa: E402  (it subclasses Format, defined above)

FORMATS = {f.name: f for f in (GGUF(), Safetensors(), Config(), Bundle(), Dump(), Encodings(), DiffInputs(), CLI(),
                               DatasetReference(), DatasetResume(), AimetOnnxEncodings(), QDQModel())}
