"""Linear layers on weights packed once for the CPU: the native kernel (cpu_linear.cpp) in fp32, oneDNN.

torch's fp32 `F.linear` on the CPU calls MKL's sgemm, which on AMD CPUs takes a generic path. For the few-row
products that decode steps and a warm request's new tokens are made of, oneDNN's matmul on a weight reordered
once (what torch's inductor does for frozen CPU graphs) is faster, and still somewhat faster at thousands of
rows (a cold prefill). The native kernel on weights packed into 64-column panels is faster again at few rows
and level with oneDNN at hundreds to thousands (the figures: BENCHMARKS.md, "CPU kernel choices"). The dense weight is
dropped after packing, so the weights are not held twice — except the output head of a tied-embedding model,
which needs the embedding table dense for lookups and a packed copy for the head.

Kinds: "native" (fp32; oneDNN where the kernels cannot be built or for bf16), "onednn", "torch" (F.linear)."""

from __future__ import annotations

import torch
from torch import nn

from . import native

PACKED_DTYPES = (torch.float32, torch.bfloat16)
PANEL = 64  # output columns per packed panel (cpu_linear.cpp)
KINDS = ("native", "onednn", "torch")


def onednn_linear_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or not onednn_linear_available():
        return False
    # oneDNN's bf16 matmul needs AVX-512 (BW/VL/DQ) or newer; elsewhere bf16 stays on F.linear.
    return weight.dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x W^T + b for 2-D x, with W held in oneDNN's layout. Not part of any state dict."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            # Plain attributes, not buffers: the opaque tensor must never be moved, saved or compared.
            self.__dict__["packed"] = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
            self.__dict__["bias"] = None if bias is None else bias.detach().contiguous()

    @classmethod
    def stacked(cls, linears) -> "PackedLinear":
        """One product computing several nn.Linear of the same input, their outputs side by side."""
        return cls(*_stack(linears))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def fp32_rows(x: torch.Tensor, in_features: int, kernel: str) -> torch.Tensor:
    """x as the native kernels take it: fp32 rows [n, in_features] on the CPU, unit stride along a row."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] != in_features:
        raise ValueError(f"{kernel} takes fp32 CPU input [rows, {in_features}], got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    return x if x.stride(1) == 1 else x.contiguous()


class NativeLinear(nn.Module):
    """y = x W^T + b for 2-D fp32 x on the CPU, through the native kernel, with W packed into panels of 64
    output columns ([panels, in_features, 64], zero-padded). Not part of any state dict."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        library = native.load()
        if library is None or not native_can_pack(weight):
            raise ValueError("NativeLinear needs fp32 CPU weights and the built kernels")
        self.out_features, self.in_features = weight.shape
        panels = -(-self.out_features // PANEL)
        pad = panels * PANEL - self.out_features
        with torch.no_grad():
            w = torch.nn.functional.pad(weight.detach(), (0, 0, 0, pad)) if pad else weight.detach()
            self.__dict__["panels"] = w.view(panels, PANEL, self.in_features).transpose(1, 2).contiguous()
            self.__dict__["bias"] = None if bias is None else torch.nn.functional.pad(bias.detach(), (0, pad)).contiguous()
        self.__dict__["_fn"] = library.kv_linear_f32

    @classmethod
    def stacked(cls, linears) -> "NativeLinear":
        return cls(*_stack(linears))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = fp32_rows(x, self.in_features, "NativeLinear")
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if x.shape[0]:
            self._fn(x.data_ptr(), x.shape[0], x.stride(0), self.in_features, self.panels.data_ptr(),
                     None if self.bias is None else self.bias.data_ptr(), self.out_features, y.data_ptr(),
                     torch.get_num_threads())
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def native_can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def _stack(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of several nn.Linear of one input stacked, and their biases (zeros where one has none)."""
    weight = torch.cat([lin.weight for lin in linears])
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat([torch.zeros(lin.out_features, dtype=weight.dtype, device=weight.device)
                              if b is None else b for lin, b in zip(linears, biases)])


def packer(weight: torch.Tensor, kind: str):
    """The packed-linear class that serves `weight` for this kind of CPU matmul, or None (keep nn.Linear)."""
    if kind not in KINDS:
        raise ValueError(f"unknown cpu matmul kind {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "native" and native_can_pack(weight) and native.load() is not None:
        return NativeLinear
    if kind in ("native", "onednn") and can_pack(weight):
        return PackedLinear
    return None


def pack_linear_layers(module: nn.Module, kind: str = "native") -> int:
    """Replace every nn.Linear below `module` whose weight can be packed for `kind`; returns how many."""
    replaced = 0
    for name, child in list(module.named_children()):
        cls = packer(child.weight, kind) if isinstance(child, nn.Linear) else None
        if cls is not None:
            setattr(module, name, cls(child.weight, child.bias))
            replaced += 1
        else:
            replaced += pack_linear_layers(child, kind)
    return replaced
