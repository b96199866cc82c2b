"""Pure kernels: arrays in, arrays out. No config, no model, no I/O.

Each function's docstring gives its formula, the shapes and where it casts. Arrays are computed in their
own floating dtype, promoted to at least float32 (float64 inputs give the float64 oracle mode).
"""
