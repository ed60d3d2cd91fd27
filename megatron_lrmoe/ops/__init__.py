"""Ops tier: functional wrappers over the compiled kernels, with pure-torch fallbacks.

Modules call these functions; the functions pick a backend through
``megatron_lrmoe.ops.backend`` (the only importer of the compiled extension).
"""

from megatron_lrmoe.ops.backend import (
    BACKEND_CHOICES,
    cuda_kernels_available,
    debug_checks,
    describe_backend,
    deterministic_mode,
    kernels_available,
    resolve_backend,
    set_debug_checks,
)
from megatron_lrmoe.ops.combine import (
    combine_rows,
    combine_rows_backward,
    combine_rows_backward_reference,
    combine_rows_reference,
)
from megatron_lrmoe.ops.scatter_add_rows import scatter_add_rows, scatter_add_rows_reference
from megatron_lrmoe.ops.select import select_rows, select_rows_reference

__all__ = [
    "BACKEND_CHOICES",
    "combine_rows",
    "combine_rows_backward",
    "combine_rows_backward_reference",
    "combine_rows_reference",
    "cuda_kernels_available",
    "debug_checks",
    "describe_backend",
    "deterministic_mode",
    "kernels_available",
    "resolve_backend",
    "scatter_add_rows",
    "scatter_add_rows_reference",
    "select_rows",
    "select_rows_reference",
    "set_debug_checks",
]
