"""RMSNorm, the MLP's SiLU or GELU gating and RoPE through the C++ kernels (cpu_ops.cpp), fp32 on the CPU: one
pass each instead of torch's six, two and five ops (a warm request's 17 rows: ~50 us -> a few us a call; RoPE of one
decode token: ~25 us -> ~1 us, bit for bit torch's)."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import native


class NativeOps:
    def __init__(self, library: ctypes.CDLL):
        self._rms_norm = library.kv_rms_norm_f32
        self._silu_mul = library.kv_silu_mul_f32
        self._gelu_mul = library.kv_gelu_mul_f32
        self._rope = library.kv_rope_f32
        self._argmax = library.kv_argmax_f32

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
        return self._gated(self._silu_mul, gate_up)

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """As silu_mul with GELU's tanh approximation (GeGLU): gelu(gate) * up, [rows, n]."""
        return self._gated(self._gelu_mul, gate_up)

    @staticmethod
    def _gated(kernel, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=torch.float32)
        kernel(gate_up.data_ptr(), rows, width // 2, out.data_ptr(), torch.get_num_threads())
        return out

    def argmax(self, x: torch.Tensor) -> list[int]:
        """x.argmax(-1).tolist() for x [rows, n] (takes(x)), in one pass a row instead of torch's one by one."""
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
        return out.tolist()

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """rope.apply_rotary(x, cos, sin) for x [T, heads, head_dim] (heads contiguous within a token; the
        token stride may be wider) and cos/sin [T, head_dim]; None where the kernel does not take them."""
        if not (x.dtype == cos.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3
                and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.is_contiguous() and sin.is_contiguous()
                and cos.shape == sin.shape == (x.shape[0], x.shape[2])):
            return None
        out = torch.empty(x.shape, dtype=torch.float32)
        if self._rope(x.data_ptr(), x.shape[0], x.shape[1], x.shape[2], x.stride(0), cos.data_ptr(),
                      sin.data_ptr(), out.data_ptr()) != 0:
            return None
        return out


@functools.cache
def load() -> NativeOps | None:
    """The ops, built with the other kernels on first use; None where they cannot be built."""
    library = native.load()
    return None if library is None else NativeOps(library)
