"""Shared by the GPU test modules of this folder. The guard every multi-rank module starts with:
``torch, dist = require_torchrun_gpus()`` skips the importing module at collection unless
torch with CUDA and NCCL is installed and this process is one of >= 2 torchrun ranks
(scripts/torch-gpu.sh)."""

import os

import pytest


def require_torchrun_gpus():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not hasattr(torch, "cuda"):  # without torch, "torch" is this folder (a namespace package)
        pytest.skip("torch is not installed", allow_module_level=True)
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available", allow_module_level=True)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available", allow_module_level=True)
    if "MASTER_ADDR" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        pytest.skip("needs >= 2 ranks under torchrun (scripts/torch-gpu.sh)", allow_module_level=True)
    return torch, dist


def gelu_tanh_grad(pre):
    """d gelu(x) / dx of the tanh-approximate GELU (cuBLASLt's DGELU epilogue, TE's "gelu")
    at ``pre``, in float32: the reference the DGELU tests multiply by."""
    x = pre.float()
    c = 0.7978845608028654
    t = (c * (x + 0.044715 * x ** 3)).tanh()
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
