"""Kernels: each op has a PyTorch reference and (where written) a Triton kernel with the same signature.

`use_triton(t)` decides per call: Triton on CUDA tensors, the reference elsewhere. Tests force the
Triton path on CPU with TRITON_INTERPRET=1 and compare it against the reference.
"""
from peagle_kernels.dispatch import set_triton_enabled, triton_enabled, use_triton

__all__ = ["set_triton_enabled", "triton_enabled", "use_triton"]
