"""What the host tier's entries are stored in: pinned (page-locked) memory beside a CUDA pool, so that a block
demoted to RAM is copied into it straight from the device without the engine waiting, and a block fetched back
crosses asynchronously on the upload stream (KVPool.upload takes pinned memory only); plain memory beside a CPU
pool, where the pool already is host RAM and pinning would buy nothing.

Torch's pinned allocations go through its caching host allocator: an entry let go returns its pages for the
next export instead of unpinning them (unpinning is as slow as pinning), and memory a copy still reads is not
handed out again before the copy is done."""
from __future__ import annotations

import torch


class PageableMemory:
    """Plain host memory."""

    pinned = False

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` in this memory, owning its own buffer (a row let out of its export's batch)."""
        return tensor.clone()


class PinnedMemory(PageableMemory):
    """Page-locked host memory, which CUDA copies to and from asynchronously."""

    pinned = True

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.empty(tuple(tensor.shape), tensor.dtype).copy_(tensor)


def host_memory_for(device: "torch.device | str") -> PageableMemory:
    """The memory host-tier entries of a pool on `device` are kept in: pinned beside a CUDA pool, else plain."""
    return PinnedMemory() if torch.device(device).type == "cuda" else PageableMemory()
