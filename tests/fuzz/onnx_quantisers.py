"""Fuzzed formats of issue 27: aimet-onnx encodings (the 1.0.0 JSON and the ONNX model beside them) and QDQ ONNX
models; their base files and the structural ONNX edits are onnx_bases.py's."""

import json
import shutil
from pathlib import Path

from .formats import Format  # formats.py imports this module after defining Format
from .mutate import apply, byte_op, fs_op, json_op
from .onnx_bases import aimet_onnx_encodings, exercise, onnx_edit, onnx_op, qdq_model, weights_model


class _OnnxFormat:
    """Shared: materialise applies the ["onnx", ...] edits besides mutate.apply's ops."""

    def materialise(self, case: Path, ops: list) -> None:
        shutil.copytree(self.root / ops[0][1], case, symlinks=True)
        for op in ops[1:]:
            if op[0] == "onnx":
                onnx_edit(case / op[1], op[2])
            else:
                apply(case, op)

    def _model(self, base: str, rel: str):
        import onnx
        if not hasattr(self, "_models"):
            self._models = {}
        if (base, rel) not in self._models:
            self._models[base, rel] = onnx.load_model_from_string((self.root / base / rel).read_bytes())
        return self._models[base, rel]


# ---------------------------------------------------------------------------------------------------- formats

class AimetOnnxEncodings(_OnnxFormat, Format):
    """aimet-onnx's 1.0.0 encodings with the ONNX model beside them (read for the weights' axes)."""
    name = "aimet-onnx"
    edits = (1, 3)
    contained = False

    def build(self, root):
        model, w = weights_model()
        (root / "export").mkdir()
        (root / "export" / "model.onnx").write_bytes(model.SerializeToString())
        (root / "export" / "model.encodings").write_text(json.dumps(aimet_onnx_encodings(w), indent=1))

    def op(self, rng, base):
        r = rng.random()
        if r < 0.75:
            doc, paths = self._json(base, "model.encodings")
            keys = ("scale", "offset", "bw", "block_size", "enc_type", "dtype", "name", "is_sym",
                    "per_block_int_scale", "compressed_bw", "exponent_bits", "version")
            return json_op(rng, "model.encodings", doc, paths, prefer=lambda p: bool(p) and p[-1] in keys or (
                len(p) >= 2 and isinstance(p[-2], str) and p[-2] in ("scale", "offset", "per_block_int_scale")))
        if r < 0.92:
            return onnx_op(rng, "model.onnx", self._model(base, "model.onnx"))
        f = rng.choice(["model.encodings", "model.onnx"])
        if r < 0.97:
            return byte_op(rng, f, (self.root / base / f).stat().st_size)
        return fs_op(rng, f, ["model.encodings", "model.onnx"])

    def target(self, case, base):
        from refimpl.encodings import read_onnx_encodings
        for enc in read_onnx_encodings(case / "model.encodings").values():
            exercise(enc)


class QDQModel(_OnnxFormat, Format):
    """A QDQ ONNX model read as its float graph and encodings."""
    name = "qdq"
    edits = (1, 3)
    contained = False

    def build(self, root):
        (root / "qdq").mkdir()
        (root / "qdq" / "model.onnx").write_bytes(qdq_model().SerializeToString())

    def op(self, rng, base):
        r = rng.random()
        if r < 0.85:
            return onnx_op(rng, "model.onnx", self._model(base, "model.onnx"))
        if r < 0.97:
            return byte_op(rng, "model.onnx", (self.root / base / "model.onnx").stat().st_size)
        return fs_op(rng, "model.onnx", ["model.onnx"])

    def target(self, case, base):
        from refimpl.formats.qdq import read_qdq
        graph, encodings = read_qdq(case / "model.onnx")
        for enc in encodings.values():
            exercise(enc)

