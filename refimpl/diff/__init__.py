"""Diffing a device dump against the golden: metrics (metrics.py); matching, divergence and reports to come."""
