"""The CPU code a model's modules run on, held in one object that the model shares with every module it
builds: the native RMSNorm and SiLU gating (cpu_ops), the paged attention kernel (cpu_attention) and the fused
decode (fused_decode), or None for torch's own ops and the per-op path. The model is its one writer
(`LlamaModel.pack_for_cpu`, `use_cpu_attention_kernel`, `use_fused_decode`);
modules only read it, so nothing is written into modules from outside and nothing lives in module globals."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CpuBackend:
    ops: object | None = None  # cpu_ops.NativeOps: RMSNorm, SiLU gating (fp32 on the CPU, kernels built)
    attention: object | None = None  # cpu_attention.CpuAttentionKernel: attends through the paged kernel
    decode: object | None = None  # fused_decode.FusedDecode: a decode step's layers in one native call
