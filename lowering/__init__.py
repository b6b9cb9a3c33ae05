"""Lowerings: rewrite the scheduled graphs' collectives into the kernels that run them (same structure as
``passes``: ``plan_*`` analysis, ``apply_*`` transformation)."""
