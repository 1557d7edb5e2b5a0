"""The data tests' shared fixtures (defined in hfsets.py, beside the helpers they use)."""

from unit.data.hfsets import folders  # noqa: F401
