"""FX graph passes, one module each, named by what they do (installed as ``fsdp_compile.passes`` from the
repository's top-level ``passes/`` folder).

Each pass is an analysis ``plan_*(graph, ...) -> *Plan`` (pure, deterministic, frozen, ``to_json()``) and a
transformation ``apply_*(gm, plan) -> None`` that ends with ``lint_and_recompile(gm)``. Those Inductor runs
are ``fsdp_compile.passes._graph.GraphPass`` objects. When each may run: [Note: pass order] in
docs/architecture.md.
"""
