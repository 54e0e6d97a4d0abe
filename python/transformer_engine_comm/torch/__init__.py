"""PyTorch integration of transformer_engine_comm.

- Comm-GEMM ops (torch custom ops ``te_comm::*``; eager, CUDA graphs, torch.compile):
  :func:`all_gather_gemm`, :func:`gemm_reduce_scatter`, :func:`gemm_all_reduce`.
- Contexts: :func:`get_context` (cached per group / communicator kind / transport),
  :func:`destroy_contexts` (call before ``dist.destroy_process_group()``; also at exit).
- Userbuffers-style overlap objects: :class:`CommOverlap` (split AG / RS / bulk overlap on a
  registered buffer), :func:`destroy_userbuffers`.
- Autograd modules live in ``transformer_engine_comm.torch.modules`` (names not found here
  are looked up there).

Import torch before the library binds NCCL (importing this package does), so that the
library uses torch's NCCL and can run over ProcessGroupNCCL's communicators.
"""

import torch  # noqa: F401  (first: the library must bind the NCCL torch loaded)

from ._context import (
    cached_contexts,
    destroy_contexts,
    get_context,
    group_name_of,
    process_group_nccl_comm,
)
from .ops import (
    GemmAlgo,
    all_gather_gemm,
    block_offset,
    gemm_all_reduce,
    gemm_reduce_scatter,
    numroc,
    set_debug_poison,
)
from .userbuffers import CommOverlap, CommOverlapType, destroy_userbuffers

__all__ = [
    "CommOverlap",
    "CommOverlapType",
    "GemmAlgo",
    "all_gather_gemm",
    "block_offset",
    "cached_contexts",
    "destroy_contexts",
    "destroy_userbuffers",
    "gemm_all_reduce",
    "gemm_reduce_scatter",
    "get_context",
    "group_name_of",
    "numroc",
    "process_group_nccl_comm",
    "set_debug_poison",
]


def __getattr__(name):
    # The autograd modules (modules.py) are imported on first use of one of their names.
    if name.startswith("__"):
        raise AttributeError(name)
    import importlib

    try:
        modules = importlib.import_module(__name__ + ".modules")
    except ModuleNotFoundError as e:
        if e.name != __name__ + ".modules":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    try:
        return getattr(modules, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
