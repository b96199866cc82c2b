"""products.onnxruntime_cpu()'s matrix products against ONNX Runtime's CPU EP itself (an implementation we did not
write): a one-node MatMul graph per shape, both operands graph inputs (not initializers MLAS would pre-pack), one
thread, random float32 operands of two spreads; every output bit-identical. The shapes cover each MLAS path
products.mlas_sgemm names: M == 1 (MlasSgemmKernelM1Avx, K mod 4 each), N == 1 (MlasSgemmKernelM1TransposeBAvx on
swapped operands: rows in fours, a pair, a single row; K mod 8 each; batched and folded), the FMA kernel with one and
several K blocks (mlas_stride_k: N >= K, N < K at each narrowing of N's side), batched and broadcast.

The order is MLAS's x86-64 AVX / FMA3 code (AVX512F's kernel sums alike); elsewhere (ARM64, no AVX) ONNX Runtime
runs other kernels, so the test needs an x86-64 CPU with AVX and FMA. Cost: ~2 s (48 sessions).
"""

import platform

import numpy as np
import pytest

from refimpl.kernels import products

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


def _x86_fma() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx" in flags and "fma" in flags


pytestmark = pytest.mark.skipif(not _x86_fma(), reason="MLAS's x86-64 AVX / FMA3 kernels are the contract")

SHAPES = [
    # N == 1: the MoE's batched experts (gate_up, down), rows in fours / pair / single, K mod 8, folded a
    ((16, 64, 32), (16, 32, 1)), ((16, 64, 64), (16, 64, 1)), ((3, 7, 13), (3, 13, 1)), ((5, 6, 9), (5, 9, 1)),
    ((2, 3, 100), (2, 100, 1)), ((1, 8, 64), (64, 1)), ((2, 5, 33), (33, 1)), ((11, 300), (300, 1)),
    ((7, 8), (8, 1)), ((2, 2), (2, 1)),
    # M == 1 (after folding): K mod 4 = 0, 1, 2, 3; N == 1 too (M == 1 wins)
    ((1, 64), (64, 40)), ((1, 1, 37), (37, 5)), ((4, 1, 19), (4, 19, 3)), ((1, 1, 6), (1, 6, 1)), ((1, 3), (3, 1)),
    ((1, 2), (2, 9)),
    # the FMA kernel: one K block; several (K's side 256, 512, 1024 and 128); batched attention-like products
    ((8, 64), (64, 192)), ((8, 600), (600, 40)), ((8, 600), (600, 20)), ((8, 300), (300, 5)), ((8, 600), (600, 100)),
    ((6, 200), (200, 1000)), ((1, 4, 8, 32), (1, 4, 32, 32)), ((2, 4, 130), (130, 7)),
]


def ort_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    h, tp = onnx.helper, onnx.TensorProto
    g = h.make_graph([h.make_node("MatMul", ["a", "b"], ["y"])], "matmul",
                     [h.make_tensor_value_info("a", tp.FLOAT, list(a.shape)),
                      h.make_tensor_value_info("b", tp.FLOAT, list(b.shape))],
                     [h.make_tensor_value_info("y", tp.FLOAT, None)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(h.make_model(g, opset_imports=[h.make_opsetid("", 13)]).SerializeToString(),
                                   options, providers=["CPUExecutionProvider"])
    return session.run(None, {"a": a, "b": b})[0]


@pytest.mark.parametrize("spread", [0, 6])
def test_matmul_is_bit_identical_to_onnxruntime_cpu(spread):
    rng = np.random.default_rng(27 + spread)

    def operand(shape):
        return (rng.standard_normal(shape) * np.exp2(rng.integers(-spread, spread + 1, shape))).astype(np.float32)
    differ = {}
    for sa, sb in SHAPES:
        a, b = operand(sa), operand(sb)
        want = ort_matmul(a, b)
        with products.onnxruntime_cpu():
            got = products.matmul(a, b)
        assert got.shape == want.shape, (sa, sb, got.shape, want.shape)
        share = float((got.view(np.int32) == want.view(np.int32)).mean())
        if share < 1:
            differ[(sa, sb)] = share
    assert not differ, differ


def test_each_path_is_taken_where_mlas_takes_it():
    """The dispatch itself (a wrong path can agree on friendly data): N == 1 is not the FMA chain, M == 1 neither."""
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((16, 64, 32)).astype(np.float32), rng.standard_normal((16, 32, 1)).astype(np.float32)
    with products.onnxruntime_cpu():
        n1 = products.matmul(a, b)
    assert np.array_equal(n1, products.matmul_mlas_n1(a, b))
    assert not np.array_equal(n1, products.matmul_sequential_fma(a, b, 256))
    a1, b1 = rng.standard_normal((1, 37)).astype(np.float32), rng.standard_normal((37, 5)).astype(np.float32)
    with products.onnxruntime_cpu():
        m1 = products.matmul(a1, b1)
    assert np.array_equal(m1, products.matmul_mlas_m1(a1, b1))
    assert [products.mlas_stride_k(n, k) for n, k in ((192, 64), (40, 600), (20, 600), (5, 300), (100, 600))] == \
        [64, 256, 512, 1024, 128]


def test_matvec_is_linear_outside_the_runtime_and_one_column_per_token_inside(monkeypatch):
    """linear.matvec (a device graph's W x per token, the MoE experts): correctly rounded it is `linear`; in ONNX
    Runtime's order each token is one [out, in] @ [in, 1] product, however many tokens a chunk holds."""
    from refimpl.kernels import linear
    rng = np.random.default_rng(9)
    w, x = rng.standard_normal((12, 40)).astype(np.float32), rng.standard_normal((7, 40)).astype(np.float32)
    assert np.array_equal(linear.matvec(w, x).view(np.int32), linear.linear(x, w).view(np.int32))
    with products.onnxruntime_cpu():
        want = np.stack([products.matmul_mlas_n1(w, x[t][:, None])[:, 0] for t in range(7)])
        assert np.array_equal(linear.matvec(w, x).view(np.int32), want.view(np.int32))
        monkeypatch.setattr(linear, "_MATVEC_ELEMENTS", 2 * w.size)          # chunks of two tokens
        assert np.array_equal(linear.matvec(w, x).view(np.int32), want.view(np.int32))
        assert np.array_equal(want.view(np.int32), ort_matmul(np.broadcast_to(w, (7, 12, 40)).copy(),
                                                              x[:, :, None])[..., 0].view(np.int32))


REDUCTIONS = [((8, 2, 64), 1), ((8, 5, 64), 1), ((16, 8, 2048), 1), ((8, 9, 64), 1), ((4, 13, 3), 1),   # KRK
              ((1, 8, 64), 2), ((8, 8, 37), 2), ((7, 5), 1), ((3, 6), 1), ((9, 2), 1), ((6,), 0),          # KR
              ((1, 8, 64), 1), ((5, 7), 0), ((2, 3, 1), 1)]                                               # RK


def ort_reduce(op: str, x: np.ndarray, axis: int) -> np.ndarray:
    h, tp = onnx.helper, onnx.TensorProto
    g = h.make_graph([h.make_node(op, ["x", "axes"], ["y"], keepdims=0)], op,
                     [h.make_tensor_value_info("x", tp.FLOAT, list(x.shape))],
                     [h.make_tensor_value_info("y", tp.FLOAT, None)], [h.make_tensor("axes", tp.INT64, [1], [axis])])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(h.make_model(g, opset_imports=[h.make_opsetid("", 18)]).SerializeToString(),
                                   options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_reduce_sum_and_mean_are_bit_identical_to_onnxruntime_cpu():
    """products.sum inside onnxruntime_cpu() is ReduceSum's order for each of its fast paths (KR: Eigen's redux with
    each row's misaligned head; RK: rows in order; KRK: MLAS's M == 1 kernel with ones), and sum / n is ReduceMean."""
    rng = np.random.default_rng(31)
    differ = {}
    for shape, axis in REDUCTIONS:
        x = (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 9, shape))).astype(np.float32)
        with products.onnxruntime_cpu():
            got = products.sum(x, axis=axis)
        for op, mine in (("ReduceSum", got), ("ReduceMean", got / np.float32(shape[axis]))):
            share = float((mine.view(np.int32) == ort_reduce(op, x, axis).view(np.int32)).mean())
            if share < 1:
                differ[(op, shape, axis)] = share
    assert not differ, differ
