"""The block codec: what one exported KV block looks like as bytes, and the conversions between the pool's
stored tensors and those bytes (`BlockLayout`). Pure functions of tensors: the pool gathers and scatters the
blocks (it alone touches KV memory); this module only says how a block's values and scales become one
contiguous buffer, and back, in the pool's KV dtype or another (a tier may store blocks in fewer bits)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reuse_server.kv import layout as kv_layout, quant as kv_quant


@dataclass(frozen=True)
class BlockLayout:
    """What an exported block buffer holds, as `nbytes` bytes: the values, [layers, 2 (K, V), block_size,
    kv_heads, head_dim] of `dtype`, K after RoPE at the block's own positions; then, for the 8-bit dtypes,
    their fp32 scales: [layers, 2, kv_heads] for fp8 (one per block), [layers, 2, block_size, kv_heads] for
    int8 (one per token). A value is stored * scale. `nbytes` equals kv_layout's bytes per block."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, ...] | None:
        per = kv_quant.scale_per(self.dtype)
        if per is None:
            return None
        tokens = (self.block_size,) if per == "token" else ()
        return (self.num_layers, 2, *tokens, self.num_kv_heads)

    @property
    def data_nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize

    @property
    def scale_nbytes(self) -> int:
        return 0 if self.scale_shape is None else _numel(self.scale_shape) * kv_layout.SCALE_BYTES

    @property
    def nbytes(self) -> int:
        return self.data_nbytes + self.scale_nbytes

    def with_dtype(self, dtype: "torch.dtype | str") -> "BlockLayout":
        """The same blocks stored in another KV dtype (a torch dtype or a kv_layout name)."""
        return BlockLayout(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                           kv_quant.storage_dtype(dtype))

    def describe(self) -> dict:
        """The layout as plain data, for a tier's self-describing files (from_description reads it back)."""
        sections = [{"name": "values", "offset": 0, "nbytes": self.data_nbytes, "order": "layer,kv,token,head,dim",
                     "shape": list(self.shape), "dtype": _name(self.dtype)}]
        if self.scale_shape is not None:
            per = kv_quant.scale_per(self.dtype)
            sections.append({"name": "scales", "offset": self.data_nbytes, "nbytes": self.scale_nbytes,
                             "order": "layer,kv,token,head" if per == "token" else "layer,kv,head",
                             "shape": list(self.scale_shape), "dtype": "float32", "per": per,
                             "value": "stored * scale"})
        return {"order": "layer,kv,token,head,dim", "shape": list(self.shape), "dtype": _name(self.dtype),
                "kv_dtype": kv_quant.spec(self.dtype).name, "nbytes": self.nbytes, "sections": sections}

    @classmethod
    def from_description(cls, description: dict) -> "BlockLayout":
        layers, _, block_size, heads, head_dim = description["shape"]
        layout = cls(layers, block_size, heads, head_dim, kv_quant.storage_dtype(description["kv_dtype"]))
        if layout.describe() != description:
            raise ValueError(f"not a block layout this version writes: {description}")
        return layout

    def split(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block buffers uint8 [n, nbytes] -> (values [n, *shape] of dtype, scales [n, *scale_shape] fp32 or
        None); views where the bytes allow."""
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != self.nbytes:
            raise ValueError(f"expected uint8 [n, {self.nbytes}] block buffers, got {data.dtype} {tuple(data.shape)}")
        n = data.shape[0]
        values = data[:, :self.data_nbytes].view(self.dtype).view(n, *self.shape)
        if self.scale_shape is None:
            return values, None
        scales = data[:, self.data_nbytes:].contiguous().view(torch.float32).view(n, *self.scale_shape)
        return values, scales

    def join(self, values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """The inverse of split: uint8 [n, nbytes], contiguous."""
        n = values.shape[0]
        parts = [values.contiguous().view(torch.uint8).view(n, -1)]
        if scales is not None:
            parts.append(scales.to(torch.float32).contiguous().view(torch.uint8).view(n, -1))
        return torch.cat(parts, 1) if len(parts) > 1 else parts[0].contiguous()

    def decode(self, data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Block buffers -> their K/V values [n, *shape] in `dtype` (dequantized)."""
        return kv_quant.dequantize_blocks(*self.split(data), dtype)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """K/V values [n, *shape] (any float dtype) -> block buffers in this layout (fresh scales)."""
        return self.join(*kv_quant.quantize_blocks(values, self.dtype))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack(values: torch.Tensor, scales: torch.Tensor | None, stored: BlockLayout, target: BlockLayout) -> torch.Tensor:
    """Blocks as the pool stores them (values [n, *stored.shape] of stored.dtype, their scales or None) ->
    buffers in `target`'s layout, on the values' device: joined as they are in the pool's own dtype, else
    dequantized and re-encoded (fresh scales)."""
    if target.dtype == stored.dtype:
        return stored.join(values, scales)
    return target.encode(kv_quant.dequantize_blocks(values, scales))


def unpack(data: torch.Tensor, layout: BlockLayout, stored: BlockLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block buffers in `layout` -> (values, scales) in the pool's `stored` dtype (converted, fresh scales,
    where `layout` holds another dtype). ValueError when the buffers cannot be blocks of this pool."""
    check_fits(layout, stored)
    values, scales = layout.split(data)
    if layout.dtype != stored.dtype:
        values, scales = kv_quant.quantize_blocks(kv_quant.dequantize_blocks(values, scales), stored.dtype)
    return values, scales


def check_fits(layout: BlockLayout, stored: BlockLayout) -> None:
    """ValueError unless blocks in `layout` are the pool's blocks (`stored`) in some KV dtype."""
    if layout.with_dtype(stored.dtype) != stored:
        raise ValueError(f"block layout {layout} does not fit this pool's blocks {stored}")
