"""The eval sets that `disco-clip eval`'s tests read (tests/unit/eval/sets.py)."""

from unit.eval.sets import cls_set, model_dir  # noqa: F401
