"""Host backing store for paged-out chunks: per logical chunk, the K and V rows of every pooled layer.

Backends write it on a PageOut with write_back and read it on a PageIn. Bytes go in and come out unchanged
(same dtype, raw copies), so a round trip is bit-exact. A CUDA backend implements the same protocol over
pinned buffers.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class HostStore(Protocol):
    def store(self, chunk: int, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Copy the chunk's rows of one layer, each [chunk_tokens, n_kv_head, head_dim]."""

    def load(self, chunk: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The stored K and V rows of one layer (read-only views; the caller copies them into its pool)."""

    def __contains__(self, chunk: object) -> bool: ...

    def discard(self, chunk: int) -> None: ...

    @property
    def nbytes(self) -> int: ...


class MemoryHostStore:
    """Host store in numpy: one array [n_layers, 2 (K, V), chunk_tokens, n_kv_head, head_dim] per chunk."""

    def __init__(self, n_layers: int, chunk_tokens: int, n_kv_head: int, head_dim: int, dtype: np.dtype):
        self.shape = (n_layers, 2, chunk_tokens, n_kv_head, head_dim)
        self.dtype = np.dtype(dtype)
        self._chunks: dict[int, np.ndarray] = {}

    @property
    def chunk_bytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return len(self._chunks) * self.chunk_bytes

    def store(self, chunk: int, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        buf = self._chunks.get(chunk)
        if buf is None:
            buf = self._chunks[chunk] = np.empty(self.shape, self.dtype)
        for i, rows in enumerate((k, v)):
            if rows.dtype != self.dtype or rows.shape != self.shape[2:]:
                raise ValueError(f"chunk rows {rows.dtype}{rows.shape} do not match the store's "
                                 f"{self.dtype}{self.shape[2:]}")
            buf[layer, i] = rows

    def load(self, chunk: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        buf = self._chunks[chunk][layer]
        k, v = buf[0].view(), buf[1].view()
        k.flags.writeable = v.flags.writeable = False
        return k, v

    def chunk(self, chunk: int) -> np.ndarray:
        """Chunk's K/V of every layer, [n_layers, 2, chunk_tokens, n_kv_head, head_dim] (a view: copy to keep)."""
        return self._chunks[chunk]

    def put_chunk(self, chunk: int, kv: np.ndarray) -> None:
        """Install a chunk's K/V [n_layers, 2, rows <= chunk_tokens, n_kv_head, head_dim]; rows past `rows` are 0."""
        rows = kv.shape[2]
        if kv.dtype != self.dtype or kv.shape[:2] + kv.shape[3:] != self.shape[:2] + self.shape[3:] \
                or rows > self.shape[2]:
            raise ValueError(f"chunk {kv.dtype}{kv.shape} does not fit the store's {self.dtype}{self.shape}")
        buf = self._chunks[chunk] = np.zeros(self.shape, self.dtype)
        buf[:, :, :rows] = kv

    def __contains__(self, chunk: object) -> bool:
        return chunk in self._chunks

    def discard(self, chunk: int) -> None:
        self._chunks.pop(chunk, None)
