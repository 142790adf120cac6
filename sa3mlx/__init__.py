"""sa3mlx: Stable Audio 3 LoRA-family fine-tuning in MLX, orchestrated by DVC.

Importing the package first points MLX's CPU BLAS at OpenBLAS on Linux; this must
happen before `mlx.core` is imported anywhere in the process.
"""

from sa3mlx.runtime.blas import ensure_fast_blas as _ensure_fast_blas

_ensure_fast_blas()

__version__ = "0.1.0"
