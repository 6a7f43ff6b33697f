"""Choosing between a Triton kernel and its PyTorch reference."""
from __future__ import annotations

import os

import torch

# None: automatic (Triton on CUDA); PEAGLE_TRITON=0 forces the PyTorch references (training needs autograd).
_ENABLED: bool | None = {"0": False, "1": True}.get(os.environ.get("PEAGLE_TRITON", ""))


def set_triton_enabled(enabled: bool | None) -> None:
    """Force Triton on (True) or off (False), or restore the automatic choice (None)."""
    global _ENABLED
    _ENABLED = enabled


def triton_enabled() -> bool | None:
    return _ENABLED


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Triton for CUDA tensors (or CPU tensors under TRITON_INTERPRET=1 when forced on)."""
    if _ENABLED is False:
        return False
    if t.is_cuda:
        return True
    return bool(_ENABLED) and interpret_mode()


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record this call: the Triton kernels have no backward, so such calls take the
    reference (drafter training on a GPU). Inference runs under no_grad/inference_mode and never does."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
