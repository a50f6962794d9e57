"""numba.cuda kernels, grouped by op; numba.cuda itself is imported only by `_numba`."""

from lucekv.kernels.cuda._numba import SIMULATOR, available, cuda

__all__ = ["SIMULATOR", "available", "cuda"]
