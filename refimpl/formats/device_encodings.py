"""A quantised device graph's encodings as read from its files (issue 27): a QDQ ONNX model itself, or an aimet-onnx
encodings JSON with the ONNX model whose tensors it names. Placed on refimpl's graph by
refimpl/models/onnx_placement.py."""

from .onnx_graph import read_onnx


def read_device_encodings(p):
    """(OnnxGraph, {ONNX tensor name: Encoding}) of a precision policy whose encodings are a device graph's
    (Policy.device_graph), else None."""
    if not p.device_graph:
        return None
    if p.onnx is None:
        from .qdq import read_qdq  # QDQ pairs removed, their scales / zero points as encodings
        return read_qdq(p.encodings)
    from ..encodings import read_onnx_encodings
    return read_onnx(p.onnx), read_onnx_encodings(p.encodings, model=p.onnx)
