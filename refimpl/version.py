"""refimpl's version: what manifests record (its own module, so writers below the package need not import it)."""

__version__ = "0.1.0"
