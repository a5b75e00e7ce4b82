"""Linear layers and embeddings on weights held in fewer bits (quant_weights.QuantizedWeight).

Decode reads every weight once per step, so its time is the weights' bytes: int4 with a scale and minimum per
group of 32 reads 5 bits a weight where fp32 reads 32. Kernels, by device:
- CPU: the native kernel (cpu_quant.cpp): codes widened to fp32 in registers and multiplied with fp32
  activations; torch's own int4 CPU kernel (`_weight_int4pack_mm_for_cpu`) is the other candidate for int4
  (torch's int8 kernel takes one scale per output, not per group). Which one serves is measured once at start
  on this model's layer shapes (`choose_cpu_kernel`) and logged; a kernel is only a candidate if a row's result
  does not depend on the other rows of its step (prefix reuse stays exact). A kind without any kernel here
  (int8/bf16 where the native kernels cannot be built) runs on its dequantized fp32 weights (oneDNN).
- CUDA, and any compute dtype other than fp32 (CUDA's paths are checked on the CPU in bf16, and on a lent GPU
  by `make gpu-check`): bf16 weights as one dense matrix in the compute dtype (DenseLinear: the tensor cores'
  own product, no widening per call); int4 through torch's `_weight_int4pack_mm` (bf16 activations, sm80+);
  int8 with one scale per output through torch's `_weight_int8pack_mm`; other int8 (GGUF's Q8_0: a scale per
  32 inputs, which that kernel cannot take) and int4 shapes torch's kernel does not take are dequantized per
  call to the compute dtype (the memory saving without the speed).
- Anywhere else (and before packing): QuantizedLinear, the reference: dequantize, then F.linear.

Before `pack_quantized` the model holds QuantizedLinear / QuantizedEmbedding placeholders (the loader's);
packing replaces them by the chosen kernel's modules, q/k/v and gate/up each as one product, as
LlamaModel.pack_for_cpu does for fp32."""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_ops, native
from .cpu_linear import PackedLinear, can_pack, fp32_rows
from .quant_weights import QuantizedWeight, dequantize_rows, stack

log = logging.getLogger(__name__)

PANEL = 64  # output columns per panel (cpu_quant.cpp)
_FORMATS = {"bf16": 0, "int8": 1, "int4": 2}
_FORMATS_A8 = {"int8": 3, "int4": 4}  # the same codes with int8 activations (cpu_quant_a8.cpp)
ACTIVATION_DTYPES = ("fp32", "int8")


class QuantizedLinear(nn.Module):
    """The reference: y = x W^T + b with W dequantized per call. What the loader builds; packing replaces it."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.__dict__["qweight"] = weight  # not a buffer: the layout is not a state dict entry
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qweight.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.qweight.kind}, in_features={self.in_features}, out_features={self.out_features}"


class QuantizedEmbedding(nn.Module):
    """Rows of a quantized table, dequantized on lookup (a step embeds only its own tokens)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.__dict__["qweight"] = weight
        self.__dict__["rows"] = lambda ids: dequantize_rows(weight, ids)
        self.dtype = dtype
        self._device = weight.codes.device

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dense (a tied head's product before packing; not for serving)."""
        return self.rows(torch.arange(self.num_embeddings, device=self._device)).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.rows(flat).to(self.dtype).view(*ids.shape, self.embedding_dim)

    def read_from(self, layer: "NativeQuantLinear") -> None:
        """Look rows up in the packed head instead (a tied model keeps the table once)."""
        self.__dict__["rows"] = layer.rows
        self.__dict__["qweight"] = None

    def extra_repr(self) -> str:
        kind = self.qweight.kind if self.qweight is not None else "packed head"
        return f"{kind}, {self.num_embeddings}, {self.embedding_dim}"


# ---- CPU: the native kernel -------------------------------------------------------------------------------

class NativeQuantLinear(nn.Module):
    """y = x W^T + b for 2-D fp32 x on the CPU, W's codes in panels of 64 output columns (cpu_quant.cpp).
    activations="int8" (int8/int4 codes only) quantizes each row of x to int8 per group, and the products are
    integer dot products (cpu_quant_a8.cpp): faster, but not fp32 activations' results."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, activations: str = "fp32"):
        super().__init__()
        library = native.load()
        if library is None:
            raise ValueError("NativeQuantLinear needs the built kernels")
        if activations not in ACTIVATION_DTYPES:
            raise ValueError(f"unknown activation dtype {activations!r}; choose one of {', '.join(ACTIVATION_DTYPES)}")
        if activations == "int8" and not (weight.kind in _FORMATS_A8 and weight.shape[1] % 4 == 0
                                          and weight.group % 4 == 0):
            raise ValueError(f"int8 activations take int8/int4 weights with inputs and groups in fours, not "
                             f"{weight.kind} {tuple(weight.shape)} group={weight.group}")
        self.kind, self.group, self.activations = weight.kind, weight.group, activations
        self.out_features, self.in_features = n, k = weight.shape
        panels = -(-n // PANEL)
        pad = panels * PANEL - n
        by_panel = lambda t: F.pad(t, (0, 0, 0, pad)).view(panels, PANEL, t.shape[1]).transpose(1, 2).contiguous()  # noqa: E731
        codes = by_panel(weight.codes.view(torch.int16) if weight.kind == "bf16" else weight.codes)
        if activations == "int8":
            codes = _quads(codes)
        elif weight.kind == "int4":  # byte j of a k: column j in the low nibble, column j + 32 in the high one
            codes = codes[..., :32] | (codes[..., 32:] << 4)
        self.__dict__["codes"] = codes
        # The kernel takes scales and minimums in one type: fp16 where both are, else fp32.
        parts = [t for t in (weight.scales, weight.mins) if t is not None]
        dtype = torch.float16 if all(t.dtype == torch.float16 for t in parts) else torch.float32
        self.__dict__["scales"] = None if weight.scales is None else by_panel(weight.scales.to(dtype))
        self.__dict__["mins"] = None if weight.mins is None else by_panel(weight.mins.to(dtype))
        self.__dict__["bias"] = None if bias is None else F.pad(bias.detach().float(), (0, pad)).contiguous()
        self.__dict__["_fn"] = library.kv_quant_linear_f32
        self.__dict__["_rows"] = library.kv_quant_rows
        # The kernel's arguments that never change, looked up once (a decode step makes ~150 calls); the fused
        # decode (fused_decode.py) hands them to the same kernel from C++.
        fmt = (_FORMATS_A8 if activations == "int8" else _FORMATS)[self.kind]
        self.__dict__["kernel_weights"] = (
            fmt, self.codes.data_ptr(), _ptr(self.scales), _ptr(self.mins),
            int(self.scales is not None and self.scales.dtype == torch.float16), self.group, _ptr(self.bias),
            self.out_features)

    @classmethod
    def stacked(cls, weights: list[QuantizedWeight], biases: list[torch.Tensor | None],
                activations: str = "fp32") -> "NativeQuantLinear":
        return cls(stack(weights), _stack_biases(weights, biases), activations)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = fp32_rows(x, self.in_features, "NativeQuantLinear")
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        status = self._fn(x.data_ptr(), x.shape[0], x.stride(0), self.in_features, *self.kernel_weights, y.data_ptr(),
                          torch.get_num_threads())
        if status != 0:
            raise ValueError(f"the quantized linear kernel does not take {self.kind} group={self.group}")
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows of W (the tied embedding's lookups), read out of the panels: [len(ids), in_features],
        dequantize_rows' values. int8/int4 in one native call (a decode step's few lookups, each a few hundred
        cache lines of the panels, cost ~0.2 ms as a dozen torch ops)."""
        if self.kind == "bf16":
            return self.codes[ids // PANEL, :, ids % PANEL].view(torch.bfloat16).float()
        ids = ids.to(torch.int64).contiguous()
        listed = ids.tolist()
        if listed and (min(listed) < 0 or max(listed) >= self.out_features):
            raise IndexError(f"rows must lie in [0, {self.out_features})")
        out = torch.empty(ids.numel(), self.in_features, dtype=torch.float32)
        fmt, codes, scales, mins, half_scales, group, _, _ = self.kernel_weights
        if self._rows(fmt, codes, scales, mins, half_scales, group, self.in_features, ids.data_ptr(), ids.numel(),
                      out.data_ptr()) != 0:
            raise ValueError(f"the rows kernel does not read {self.kind}")
        return out

    def extra_repr(self) -> str:
        return (f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}, group={self.group}"
                + (", int8 activations" if self.activations == "int8" else ""))


def _quads(codes: torch.Tensor) -> torch.Tensor:
    """Panels [P][K][64] of int8/int4 codes in cpu_quant_a8.cpp's layout: per 4 inputs, each column's 4 codes
    side by side; int8 stored + 128 as uint8, int4 two columns to a byte (column j low, j + 32 high)."""
    p, k, _ = codes.shape
    quads = codes.view(p, k // 4, 4, PANEL).transpose(2, 3)  # [P][K/4][64 columns][4 inputs]
    if codes.dtype == torch.int8:
        return (quads.to(torch.int16) + 128).to(torch.uint8).contiguous()
    return (quads[:, :, :32] | (quads[:, :, 32:] << 4)).contiguous()


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _stack_biases(weights, biases) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    return torch.cat([torch.zeros(w.shape[0]) if b is None else b.detach().float() for w, b in zip(weights, biases)])


# ---- torch's kernels ---------------------------------------------------------------------------------------

class TorchInt4Linear(nn.Module):
    """int4 through torch's kernels: `_weight_int4pack_mm_for_cpu` (fp32 activations) on the CPU,
    `_weight_int4pack_mm` (bf16 activations) on CUDA. torch's int4 is w = (q - 8) * scale + zero, so the
    zero is m + 8 * s (one rounding: not bitwise the GGUF values, within an ulp)."""

    GROUPS = (32, 64, 128, 256)

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, device="cpu",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if not self.takes(weight, device):
            raise ValueError(f"torch's int4 kernel does not take {weight.kind} {weight.shape} group={weight.group}")
        self.out_features, self.in_features = n, k = weight.shape
        self.group, self.dtype = weight.group, dtype
        scales = weight.scales.float()
        zeros = (weight.mins.float() if weight.mins is not None else torch.zeros_like(scales)) + 8 * scales
        self.__dict__["scales_and_zeros"] = torch.stack([scales.t(), zeros.t()], -1).contiguous().to(device, dtype)
        codes = weight.codes.to(device)
        if torch.device(device).type == "cuda":
            packed = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
            self.__dict__["packed"] = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
            self.__dict__["_mm"] = torch.ops.aten._weight_int4pack_mm
        else:
            self.__dict__["packed"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            self.__dict__["_mm"] = torch.ops.aten._weight_int4pack_mm_for_cpu
        self.__dict__["bias"] = None if bias is None else bias.detach().to(device, dtype)

    @classmethod
    def takes(cls, weight: QuantizedWeight, device="cpu") -> bool:
        n, k = weight.shape
        cuda = torch.device(device).type == "cuda"
        op = "_weight_int4pack_mm" if cuda else "_weight_int4pack_mm_for_cpu"
        return (weight.kind == "int4" and weight.group in cls.GROUPS and k % weight.group == 0
                and hasattr(torch.ops.aten, op) and (not cuda or (k % 128 == 0 and n % 8 == 0)))

    @classmethod
    def stacked(cls, weights, biases, **kw) -> "TorchInt4Linear":
        return cls(stack(weights), _stack_biases(weights, biases), **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(x.to(self.dtype).contiguous(), self.packed, self.group, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"int4, in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


class TorchInt8Linear(nn.Module):
    """int8 codes with one scale per output (no minimum) through torch's `_weight_int8pack_mm` (CPU and CUDA):
    y = (x W_codes^T) * scale. GGUF's Q8_0 has a scale per 32 inputs, which this kernel cannot take."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, device="cpu",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if not self.takes(weight):
            raise ValueError(f"torch's int8 kernel does not take {weight.kind} {weight.shape} group={weight.group}"
                             f"{' with minimums' if weight.mins is not None else ''}")
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.__dict__["codes"] = weight.codes.to(device).contiguous()
        self.__dict__["scales"] = weight.scales.reshape(-1).to(device, dtype).contiguous()
        self.__dict__["bias"] = None if bias is None else bias.detach().to(device, dtype)

    @classmethod
    def takes(cls, weight: QuantizedWeight) -> bool:
        return (weight.kind == "int8" and weight.mins is None and weight.group >= weight.shape[1]
                and hasattr(torch.ops.aten, "_weight_int8pack_mm"))

    @classmethod
    def stacked(cls, weights, biases, **kw) -> "TorchInt8Linear":
        return cls(stack(weights), _stack_biases(weights, biases), **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.dtype).contiguous(), self.codes,
                                               self.scales)
        y = y.view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"int8, in_features={self.in_features}, out_features={self.out_features}, scale per output"


class DenseLinear(nn.Module):
    """bf16 weights as one dense matrix in the compute dtype, converted once when packed: on CUDA in bf16 the
    matrix is the codes themselves and the product is cuBLAS's on the tensor cores (DequantLinear would widen
    the whole matrix through fp32 on every call)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if weight.kind != "bf16":
            raise ValueError(f"DenseLinear holds bf16 weights, not {weight.kind}")
        self.out_features, self.in_features = weight.shape
        self.__dict__["weight"] = weight.codes.to(dtype).contiguous()
        self.__dict__["bias"] = None if bias is None else bias.detach().to(weight.codes.device, dtype)

    @classmethod
    def stacked(cls, weights, biases, **kw) -> "DenseLinear":
        return cls(stack(weights), _stack_biases(weights, biases), **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"bf16 dense in {self.weight.dtype}, in_features={self.in_features}, out_features={self.out_features}"


class DequantLinear(QuantizedLinear):
    """The codes on the device, dequantized per call to the compute dtype: memory saved, speed not gained.
    CUDA's int8 and bf16, and int4 shapes torch's kernel does not take."""

    @classmethod
    def stacked(cls, weights, biases, **_) -> "DequantLinear":
        return cls(stack(weights), _stack_biases(weights, biases))


# ---- choosing and packing ----------------------------------------------------------------------------------

CPU_KERNELS = {"native": NativeQuantLinear, "torch": TorchInt4Linear}


def choose_cpu_kernel(kind: str, shapes: list[tuple[int, int]], rows=(1, 64), seed: int = 0,
                      allow_native: bool = True) -> str:
    """The CPU kernel for weights of `kind`, measured on these [out, in] shapes (one representative layer's
    products) at decode and prefill row counts, in this process. A candidate must give every row the result
    it gives that row alone (prefix reuse stays exact). Logs the timings and the choice."""
    candidates = ["native"] if allow_native and native.load() is not None else []
    if kind == "int4" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        candidates.append("torch")
    if len(candidates) <= 1:
        choice = candidates[0] if candidates else "reference"
        log.info("quantized %s linear layers on the CPU: %s (the only candidate here)", kind,
                 "fp32 weights: no kernel for this kind" if choice == "reference" else f"{choice} kernel")
        return choice
    from .gguf_quant import quantize

    gen = torch.Generator().manual_seed(seed)
    weights = [quantize(torch.randn(n, k, generator=gen) * 0.05, kind) for n, k in shapes]
    timings = {}
    for name in candidates:
        cls = CPU_KERNELS[name]
        if not all(cls is NativeQuantLinear or cls.takes(w) for w in weights):
            continue
        layers = [cls(w) for w in weights]
        if not _batch_invariant(layers, weights, gen):
            log.info("quantized %s: %s kernel skipped: a row's result depends on the other rows of its step", kind, name)
            continue
        timings[name] = sum(_time(layer, torch.randn(m, w.shape[1], generator=gen))
                            for m in rows for layer, w in zip(layers, weights))
    best = min(timings, key=timings.get)
    log.info("quantized %s linear layers on the CPU: %s kernel (measured at start, rows %s of %d shapes: %s)",
             kind, best, "/".join(map(str, rows)), len(shapes),
             ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in timings.items()))
    return best


def _batch_invariant(layers, weights, gen) -> bool:
    for layer, w in zip(layers, weights):
        x = torch.randn(17, w.shape[1], generator=gen)
        together = layer(x)
        if not all(torch.equal(layer(x[i:i + 1])[0], together[i]) for i in (0, 5, 16)):
            return False
    return True


def _time(layer, x, repeats: int = 2) -> float:
    layer(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        layer(x)
        best = min(best, time.perf_counter() - start)
    return best


def holds_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules())


def pack_quantized(model: nn.Module, matmul: str = "native", activations: str = "fp32") -> int:
    """Replace the loader's QuantizedLinear placeholders of a LlamaModel by the kernels that serve them on its
    device, q/k/v and gate/up each as one product, the head packed (a tied model's embedding then reads the
    packed head). `matmul` is --cpu-matmul: "native" lets the native kernel compete at start; otherwise only
    torch's kernels do (and kinds without one run on fp32 weights). activations="int8": the int8/int4 products
    run on int8 activations through the native kernel (ValueError where it cannot). Returns the number of layers
    replaced."""
    embed = model.embed_tokens
    device = embed.qweight.codes.device if isinstance(embed, QuantizedEmbedding) else embed.weight.device
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not linears and not isinstance(embed, QuantizedEmbedding):
        return 0
    kinds = {m.qweight.kind for m in linears}
    if isinstance(embed, QuantizedEmbedding) and model.lm_head is None:  # the tied head is a product too
        kinds.add(embed.qweight.kind)
    dtype = embed.dtype if isinstance(embed, QuantizedEmbedding) else embed.weight.dtype
    if activations == "int8":
        make = _int8_activations_maker(device, dtype, matmul)
    else:
        make = _maker(device, dtype, kinds, model.layers[0], matmul == "native")
    packed = 0
    ops = cpu_ops.load() if device.type == "cpu" and dtype == torch.float32 else None
    model.backend.ops = ops  # norms and the gating of stacked gate/up products run natively
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        if all(isinstance(p, QuantizedLinear) for p in qkv):
            attn.qkv_proj = make([p.qweight for p in qkv], [p.bias for p in qkv])
            attn.q_proj = attn.k_proj = attn.v_proj = None
            packed += 3
        if ops is not None and isinstance(mlp.gate_proj, QuantizedLinear) and isinstance(mlp.up_proj, QuantizedLinear):
            mlp.gate_up_proj = make([mlp.gate_proj.qweight, mlp.up_proj.qweight], [None, None])
            mlp.gate_proj = mlp.up_proj = None
            packed += 2
        for parent, name in ((attn, "o_proj"), (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")):
            child = getattr(parent, name)
            if isinstance(child, QuantizedLinear):
                setattr(parent, name, make([child.qweight], [child.bias]))
                packed += 1
    if isinstance(model.lm_head, QuantizedLinear):
        model.lm_head = make([model.lm_head.qweight], [model.lm_head.bias])
        packed += 1
    elif model.lm_head is None and isinstance(embed, QuantizedEmbedding):
        head = make([embed.qweight], [None])
        model.use_packed_head(head)
        if isinstance(head, NativeQuantLinear):
            embed.read_from(head)
        packed += 1
    with torch.no_grad():  # dense parameters loaded as views of the file's memory map: copy them out
        for param in model.parameters():
            param.data = param.data.clone()
    return packed


def _int8_activations_maker(device: torch.device, dtype: torch.dtype, matmul: str):
    """make(weights, biases) for --activation-dtype int8: the native kernel's integer products; a product it
    does not take (bf16 codes, inputs not in fours) keeps fp32 activations."""
    if device.type != "cpu" or dtype != torch.float32 or matmul != "native" or native.load() is None:
        why = native.failure() if native.load() is None else f"{device.type}, {dtype}, --cpu-matmul {matmul}"
        raise ValueError(f"int8 activations run only in the native CPU kernel in float32 ({why})")
    if "avx512_vnni" not in native.cpu_flags():
        log.warning("int8 activations without AVX-512 VNNI on this CPU: the integer products run in plain C++, "
                    "likely slower than --activation-dtype fp32")

    def make(weights, biases):
        merged = stack(weights)
        bias = _stack_biases(weights, biases)
        try:
            return NativeQuantLinear(merged, bias, "int8")
        except ValueError as exc:
            log.info("%s: fp32 activations for this product", exc)
            return NativeQuantLinear(merged, bias)
    return make


def _maker(device: torch.device, dtype: torch.dtype, kinds: set[str], layer, allow_native: bool):
    """make(weights, biases) -> the module serving those weights stacked, on this device."""
    if device.type == "cpu" and dtype == torch.float32:
        choice = {}
        for kind in kinds:
            a = layer.self_attn
            shapes = [p.qweight.shape for p in (a.q_proj, a.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj)
                      if isinstance(p, QuantizedLinear) and p.qweight.kind == kind]
            choice[kind] = choose_cpu_kernel(kind, shapes or [(256, 256)], allow_native=allow_native)

        def make(weights, biases):
            name = choice[weights[0].kind]
            if name == "reference":  # no kernel for this kind here: fp32 weights on oneDNN (or F.linear)
                merged, bias = stack(weights).dequantize(), _stack_biases(weights, biases)
                return PackedLinear(merged, bias) if can_pack(merged) else DequantLinear(stack(weights), bias)
            cls = CPU_KERNELS[name]
            if cls is TorchInt4Linear and not cls.takes(stack(weights)):
                cls = NativeQuantLinear if native.load() is not None else DequantLinear
            return cls.stacked(weights, biases)
        return make

    def make(weights, biases):
        merged, bias = stack(weights), _stack_biases(weights, biases)
        return device_linear(merged, bias, device, dtype)
    return make


def device_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
                  dtype: torch.dtype) -> nn.Module:
    """The module serving `weight` off the CPU's fp32 path (CUDA, or a compute dtype other than fp32): dense
    bf16, then torch's int4 and int8 kernels where their shapes allow, else dequantizing per call."""
    if weight.kind == "bf16":
        return DenseLinear(weight, bias, dtype)
    if TorchInt4Linear.takes(weight, device) and dtype == torch.bfloat16:
        return TorchInt4Linear(weight, bias, device=device, dtype=dtype)
    if TorchInt8Linear.takes(weight):
        return TorchInt8Linear(weight, bias, device=device, dtype=dtype)
    return DequantLinear(weight, bias)
