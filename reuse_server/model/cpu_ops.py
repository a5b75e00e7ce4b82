"""RMSNorm and the MLP's SiLU gating through the C++ kernels (cpu_ops.cpp), fp32 on the CPU: one pass each
instead of torch's six and two ops (a warm request's 17 rows: ~50 us -> a few us a call)."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import native


class NativeOps:
    def __init__(self, library: ctypes.CDLL):
        self._rms_norm = library.kv_rms_norm_f32
        self._silu_mul = library.kv_silu_mul_f32

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [rows, hidden] (takes(x)); weight: [hidden] fp32, contiguous."""
        out = torch.empty(x.shape, dtype=torch.float32)
        self._rms_norm(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), eps, out.data_ptr(),
                       torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2n] contiguous, the gate and up projections side by side -> silu(gate) * up, [rows, n]."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), rows, width // 2, out.data_ptr(), torch.get_num_threads())
        return out


@functools.cache
def load() -> NativeOps | None:
    """The ops, built with the other kernels on first use; None where they cannot be built."""
    library = native.load()
    return None if library is None else NativeOps(library)
