"""Lowerings: rewrite the scheduled graphs' collectives into the kernels that run them (installed as
``fsdp_compile.lowering`` from the repository's top-level ``lowering/`` folder; same structure as
``fsdp_compile.passes``: ``plan_*`` analysis, ``apply_*`` transformation)."""
