"""The eval tests' shared fixtures (defined in sets.py, beside the helpers they use)."""

from unit.eval.sets import cls_set, hf_cls, model_dir  # noqa: F401
