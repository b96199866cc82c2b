"""NaN / Inf in a checkpoint's weights: one NonFiniteWeightWarning naming the tensor (not NumPy's RuntimeWarnings),
and the forward pass carries the values on as IEEE arithmetic does."""

import warnings

import numpy as np

import refimpl
from refimpl.models.weights import NonFiniteWeightWarning


def test_nan_and_inf_weights_warn_once_naming_the_tensor():
    model = refimpl.load("tiny-qwen3")
    name = "model.layers.1.mlp.down_proj.weight"
    w = np.array(model.weights.stored[name])
    w[0, 0], w[1, 1] = np.nan, np.inf
    model.weights.stored[name] = w
    ids = np.array([[3, 17, 42]])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = model.forward(ids)
        second = model.forward(ids)
    ours = [str(x.message) for x in seen if issubclass(x.category, NonFiniteWeightWarning)]
    assert len(ours) == 1 and name in ours[0] and "1 NaN" in ours[0] and "1 +Inf" in ours[0], ours
    assert [x for x in seen if not issubclass(x.category, NonFiniteWeightWarning)] == []
    assert np.isnan(first).all() and np.array_equal(first, second, equal_nan=True)


def test_finite_weights_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        refimpl.load("tiny-qwen3").forward(np.array([[3, 17, 42]]))
