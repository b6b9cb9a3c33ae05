"""The guard behind ``unalias_body_outputs``: a shared body's output that still aliases one of its inputs, on the graphs
Inductor compiles, is copied.

Precondition: a post-grad forward or backward graph (Inductor's ``post_grad_custom_post_pass``; under aot_eager, the
backend's), whose region calls' bodies have had their own post-grad passes (Inductor runs them on the bodies first).
Postcondition: no body that the graph calls returns one of its inputs, or a view of one; where one did, that output is
a copy (``aten.clone``), and ``debug.degraded("shared_body_output_copied")`` names the body and the input.

Why: ``unalias_body_outputs`` leaves no such output in the joint graph, but a pass after it (a torch of the future, a
post-grad pass that drops a no-op) could make one again. Taking the value from the operand is no longer sound there
(AOTAutograd has already chosen the backward's donated inputs, as if the output were a tensor of its own), so the
output becomes one: one copy per call, where Inductor would otherwise reuse the storage under it (wrong gradients,
without a word). [Note: shared bodies]

Example (a body's post-grad graph)::

    before: return (add, primals_0)
    after:  clone = aten.clone(primals_0); return (add, clone)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fsdp_compile import debug
from fsdp_compile.passes._graph import GraphPass, call_with_value, lint_and_recompile
from fsdp_compile.passes.unalias_body_outputs import UnaliasPlan, plan_unalias

__all__ = ["CopyBodyAliases", "apply_copies"]


def apply_copies(gm: fx.GraphModule, plan: UnaliasPlan) -> None:
    for alias in plan.aliases:
        debug.degraded("shared_body_output_copied", (
            f"the shared body {alias.describe()}, which Inductor would let the step overwrite while it still reads it: "
            f"that output is copied at every call (a pass after fsdp_compile.unalias_body_outputs made the alias; "
            f"fsdp_compile.backend(regions=False) compiles without shared bodies)"))
        body = getattr(gm, alias.body)
        output = body.graph.output_node()
        outputs = list(output.args[0])
        with body.graph.inserting_before(output):
            outputs[alias.output] = call_with_value(body.graph, torch.ops.aten.clone.default, outputs[alias.output])
        output.args = (tuple(outputs),)
    for target in dict.fromkeys(alias.body for alias in plan.aliases):
        lint_and_recompile(getattr(gm, target))


class CopyBodyAliases(GraphPass):
    """The guard as the first of the post-grad passes, on every graph (a body calls no body: it does nothing there)."""

    name = "copy_body_aliases"
    plan = staticmethod(plan_unalias)
    apply = staticmethod(apply_copies)

    def __call__(self, graph: fx.Graph) -> None:
        if plan_unalias(graph).aliases:  # else nothing to copy, nor to dump
            super().__call__(graph)
