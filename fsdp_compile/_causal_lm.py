"""A Hugging Face causal LM behind the ``model(inputs, targets) -> loss`` interface the tests, the examples and
``python -m fsdp_compile estimate CONFIG.json`` train and count: the cross-entropy of its logits."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CausalLMLoss"]


class CausalLMLoss(nn.Module):
    """A Hugging Face causal LM behind the ``model(inputs, targets) -> loss`` interface of ``reference_step``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=inputs).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
