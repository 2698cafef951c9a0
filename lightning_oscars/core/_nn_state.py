"""State that torch.nn modules derive from their parameters and cache between forwards, recomputed after the
parameters were replaced (averaged) in place. It reads torch's private hook and parametrization attributes, which is
why it sits in a module of its own.

* Pruning (``torch.nn.utils.prune``): the masked weight attribute the forward pre-hook sets is the next pruning's
  importance; after averaging ``weight_orig`` it still holds the local value.
* Buffers: only the persistent ones are the module's state (:func:`persistent_buffers`).
* Spectral norm (``torch.nn.utils.parametrizations.spectral_norm``): the power-iteration vectors ``_u``, ``_v`` are
  unit vectors, which their average is not.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils import prune

__all__ = ["persistent_buffers", "refresh_derived"]


def persistent_buffers(module: nn.Module) -> list[Tensor]:
    """The module's buffers that its state dict holds, in ``named_buffers`` order. A non-persistent buffer
    (``register_buffer(..., persistent=False)``: an attention mask, a position index) is what the module recomputes,
    often with a shape of the batch in hand, so ranks may hold different ones."""
    found: list[Tensor] = []
    for sub in module.modules():
        skipped = sub._non_persistent_buffers_set
        found += [b for name, b in sub._buffers.items() if b is not None and name not in skipped]
    return found


def refresh_derived(module: nn.Module) -> None:
    """Recompute what pruning and spectral norm cache between forwards, from the averaged parameters."""
    for sub in module.modules():
        for hook in list(sub._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod):
                # The masked weight the hook sets before each forward: the next pruning reads it as its importance.
                setattr(sub, hook._tensor_name, hook.apply_mask(sub))
        if type(sub).__name__ == "_SpectralNorm":
            with torch.no_grad():
                for name in ("_u", "_v"):
                    vector = getattr(sub, name, None)
                    if isinstance(vector, Tensor):
                        vector.copy_(nn.functional.normalize(vector, dim=0, eps=getattr(sub, "eps", 1e-12)))
