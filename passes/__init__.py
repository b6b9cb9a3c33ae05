"""FX graph passes, one module each, named by what they do.

Each pass is an analysis ``plan_*(graph, ...) -> *Plan`` (pure, deterministic, frozen, ``to_json()``) and a
transformation ``apply_*(gm, plan) -> None``.
"""
