"""Weights held in fewer bits than fp32: the layout, reading it back, storing it on disk (quantizing to it is
gguf_quant.quantize's, with gguf's quantizers).

A QuantizedWeight of shape [N, K] holds a code per weight and, for int8/int4, a scale and optionally a minimum
per group of `group` consecutive inputs of an output: w[n, k] = scales[n, k // group] * codes[n, k] +
mins[n, k // group]. That is the form of GGUF's Q4_0 (min -8 * scale), Q4_1, Q8_0 and its K-quants' sub-blocks,
so those load without a detour through fp32 and reproduce exactly what gguf's dequantization gives (see
gguf_quant.py). fp32/fp16/bf16 checkpoints are quantized at load with gguf's own quantizers (Q4_1 for int4:
scale and minimum per group of 32; Q8_0 for int8: a scale per group of 32).

Scales are kept in fp16 where that holds them exactly (GGUF's Q4/Q8 formats store fp16 scales), else fp32 (a
K-quant's scale is an fp16 times a 6-bit integer). In every format here scale * code is exact in fp32, so
w = s * q + m is rounded once whether the multiply-add is fused or not: the CPU kernel, torch and gguf agree
to the bit."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

WEIGHT_DTYPES = ("fp32", "bf16", "int8", "int4")
QUANT_GROUP = 32  # inputs per scale when quantizing at load (gguf's Q4_1/Q8_0 blocks)
BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4}
# Safetensors keys of a quantized weight `name`: name + suffix; the layout is in the file's metadata.
SUFFIXES = (".codes", ".scales", ".mins")
METADATA_KEY = "quantized_weights"


_HEAD_NAMES = ("embed_tokens.weight", "lm_head.weight")


def kind_for(name: str, weight_dtype: str) -> str:
    """The kind matrix `name` is held in for a weight dtype: that dtype, except that the output head and the
    embeddings keep at least 8 bits under int4 (llama.cpp's quantizers keep the output at Q6_K/Q8_0 too: the
    logits are the most sensitive product)."""
    return "int8" if weight_dtype == "int4" and name.endswith(_HEAD_NAMES) else weight_dtype


@dataclass
class QuantizedWeight:
    kind: str  # "int4" | "int8" | "bf16"
    codes: torch.Tensor  # [N, K]: uint8 0..15 (int4), int8 (int8), bfloat16 (bf16)
    scales: torch.Tensor | None  # [N, ceil(K / group)] fp32 or fp16; None for bf16
    mins: torch.Tensor | None  # like scales, or None (w = s * q)
    group: int  # inputs per scale (K for bf16)

    def __post_init__(self):
        if self.kind not in ("int4", "int8", "bf16"):
            raise ValueError(f"unknown quantized kind {self.kind!r}")
        expected = {"int4": torch.uint8, "int8": torch.int8, "bf16": torch.bfloat16}[self.kind]
        if self.codes.dtype != expected or self.codes.dim() != 2:
            raise ValueError(f"{self.kind} codes must be 2-D {expected}, got {self.codes.dtype} {tuple(self.codes.shape)}")
        if self.kind != "bf16":
            groups = -(-self.codes.shape[1] // self.group)
            for t in (self.scales, self.mins):
                if t is not None and (t.shape != (self.codes.shape[0], groups) or t.dtype not in (torch.float32, torch.float16)):
                    raise ValueError(f"scales/mins must be [{self.codes.shape[0]}, {groups}] fp32 or fp16, got "
                                     f"{t.dtype} {tuple(t.shape)}")
            if self.scales is None:
                raise ValueError(f"{self.kind} weights need scales")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the kernels hold: codes at their width (int4: half a byte) plus scales and minimums."""
        n, k = self.shape
        codes = n * k * BITS[self.kind] // 8
        return codes + sum(t.numel() * t.element_size() for t in (self.scales, self.mins) if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights as a dense [N, K] tensor, s * q + m in fp32 (exactly gguf's values), then cast."""
        return dequantize_rows(self, None).to(dtype)

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        return QuantizedWeight(self.kind, self.codes[index], None if self.scales is None else self.scales[index],
                               None if self.mins is None else self.mins[index], self.group)

    def to(self, device) -> "QuantizedWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(self.kind, move(self.codes), move(self.scales), move(self.mins), self.group)


def dequantize_rows(q: QuantizedWeight, index: torch.Tensor | None) -> torch.Tensor:
    """fp32 weights of the rows at index (all rows if None): [len(index), K]."""
    codes = q.codes if index is None else q.codes[index]
    if q.kind == "bf16":
        return codes.float()
    k = codes.shape[1]
    pick = (lambda t: t) if index is None else (lambda t: t[index])
    scales = pick(q.scales).float().repeat_interleave(q.group, dim=1)[:, :k]
    w = codes.float() * scales  # exact (module docstring), so adding the minimum rounds once as gguf does
    if q.mins is not None:
        w = w + pick(q.mins).float().repeat_interleave(q.group, dim=1)[:, :k]
    return w


def narrowest_scales(scales: torch.Tensor) -> torch.Tensor:
    """fp16 where it holds every scale exactly, else fp32."""
    scales = scales.float()
    half = scales.half()
    return half if torch.equal(half.float(), scales) else scales


def stack(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Several weights of one input as one, their outputs side by side (q/k/v, gate/up)."""
    first = weights[0]
    if any(w.kind != first.kind or w.group != first.group or w.shape[1] != first.shape[1] for w in weights):
        raise ValueError("only weights of one kind, group and input width stack")
    codes = torch.cat([w.codes for w in weights])
    if first.kind == "bf16":
        return QuantizedWeight("bf16", codes, None, None, first.group)
    scales = narrowest_scales(torch.cat([w.scales.float() for w in weights]))
    mins = None
    if any(w.mins is not None for w in weights):
        mins = narrowest_scales(torch.cat([w.mins.float() if w.mins is not None else torch.zeros_like(w.scales, dtype=torch.float32)
                                           for w in weights]))
    return QuantizedWeight(first.kind, codes, scales, mins, first.group)


# ---- on disk: safetensors tensors + one metadata entry -----------------------------------------------------

def to_tensors(name: str, q: QuantizedWeight) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors to save for weight `name` (int4 codes two to a byte: even k in the low nibble) and its layout."""
    codes = q.codes
    if q.kind == "int4":
        if codes.shape[1] % 2:
            codes = torch.nn.functional.pad(codes, (0, 1))
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    out = {name + ".codes": codes.contiguous()}
    if q.scales is not None:
        out[name + ".scales"] = q.scales.contiguous()
    if q.mins is not None:
        out[name + ".mins"] = q.mins.contiguous()
    return out, {"kind": q.kind, "group": q.group, "in_features": q.shape[1]}


def from_tensors(name: str, layout: dict, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
    codes = tensors[name + ".codes"]
    if layout["kind"] == "int4":
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1)[:, :layout["in_features"]]
    return QuantizedWeight(layout["kind"], codes.contiguous(), tensors.get(name + ".scales"),
                           tensors.get(name + ".mins"), int(layout["group"]))


def metadata_entry(layouts: dict[str, dict]) -> dict[str, str]:
    return {METADATA_KEY: json.dumps(layouts, sort_keys=True)}


def read_layouts(metadata: dict[str, str] | None) -> dict[str, dict]:
    return json.loads((metadata or {}).get(METADATA_KEY, "{}"))
