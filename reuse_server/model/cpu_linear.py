"""Linear layers through oneDNN with each weight reordered once into oneDNN's blocked layout.

torch's fp32 `F.linear` on the CPU calls MKL's sgemm, which on AMD CPUs takes a generic path. For the few-row
products that decode steps and a warm request's new tokens are made of, oneDNN's matmul on a weight reordered
once (what torch's inductor does for frozen CPU graphs) measured about 2x faster on this project's EPYC VM, and
the output head 2.3x; at thousands of rows (a cold prefill) it is ~13% faster. The dense weight is dropped after
packing, so the weights are not held twice — except the output head of a tied-embedding model, which needs the
embedding table dense for lookups and a packed copy for the head."""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)


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
        weight = torch.cat([lin.weight for lin in linears])
        biases = [lin.bias for lin in linears]
        if all(b is None for b in biases):
            return cls(weight)
        return cls(weight, torch.cat([torch.zeros(lin.out_features, dtype=weight.dtype, device=weight.device)
                                      if b is None else b for lin, b in zip(linears, biases)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linear_layers(module: nn.Module) -> int:
    """Replace every nn.Linear below `module` whose weight can be packed by a PackedLinear; returns how many."""
    replaced = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and can_pack(child.weight):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            replaced += 1
        else:
            replaced += pack_linear_layers(child)
    return replaced
