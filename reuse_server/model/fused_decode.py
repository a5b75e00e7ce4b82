"""A decode step's decoder layers in one native call (cpu_decode.cpp) instead of the per-op path's dozen ctypes
calls and torch ops per layer, whose Python costs as much as the kernels at a few rows.

The native code runs the kernels the per-op path (llama.py) calls, in its order, on the same values: the
logits and the pool's K/V are that path's bit for bit. It takes a forward whose tokens are all decode rows
(one query token per sequence, at most MAX_ROWS) that every layer keeps, over a pool it writes as
KVPool.write does; any other step runs the per-op path, where the model's arithmetic is written once. It
serves a Llama-style model packed for the CPU (LlamaModel.pack_for_cpu) whose products are all native
(fp32 panels or quantized codes), with or without q/k norms (Qwen3), and Gemma 3's extra norms, GeGLU, second
RoPE base and hybrid pool (LayeredKVPool: the full-attention and the window layers each in a pool of its own).
KV_REUSE_FUSED_DECODE=0 turns it off."""

from __future__ import annotations

import ctypes
import os
import threading
import weakref

import torch

from . import native
from .cpu_attention import FORMATS, CpuAttentionKernel, KernelPlan
from .cpu_linear import NativeLinear
from .quant_linear import NativeQuantLinear

ENV = "KV_REUSE_FUSED_DECODE"
# The most decode rows a fused step takes: the scratch buffers are sized for it, and a bigger batch spends
# little of its step in Python.
MAX_ROWS = 64
# RoPE's cos and sin are read out of tables of positions 0 .. n - 1, one per RoPE base: computing them per step
# was six torch ops. A table starts at FIRST_TABLE_POSITIONS and doubles when a step goes past it, up to
# TABLE_POSITIONS (or the model's context), so its memory follows the longest context served: SmolLM2's 0.5 MiB
# at 1,024 positions, 4 MiB at 8,192; Gemma 3's (head_dim 256, two bases) 4 MiB, and 64 MiB at 16,384. A step
# beyond the largest runs the per-op path.
FIRST_TABLE_POSITIONS = 1024
TABLE_POSITIONS = 16384
NO_TABLE, BAD_SLOT = -2, -3  # cpu_decode.cpp's refusals, each before it ran anything
FP32_PANELS = -1  # cpu_decode.cpp's format of fp32 panels; the quantized ones are kv_quant_linear_f32's
# The pools whose writes cpu_decode.cpp makes as KVPool.write does (the attention kernel's codes): fp16 and
# bf16 would need torch's rounding of the stored values.
POOL_FORMATS = {dtype: FORMATS[dtype] for dtype in (torch.float32, torch.float8_e4m3fn, torch.int8)}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


# ctypes mirrors of cpu_decode.cpp's structures, field for field.
class _Linear(ctypes.Structure):
    _fields_ = [("format", _I), ("weights", _P), ("scales", _P), ("mins", _P), ("half_scales", _I), ("group", _I),
                ("bias", _P), ("in_features", _I), ("out_features", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("window", _I), ("q_norm", _P), ("k_norm", _P), ("pre_ff_norm", _P),
                ("post_ff_norm", _P), ("rope", _I)]


SCRATCH = ("cos", "sin", "normed", "qkv", "qk", "kv", "attn", "proj", "gate_up", "act")


class _Decoder(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("intermediate", _I), ("gelu", _I), ("eps", _F), ("scale", _F), ("layers", ctypes.POINTER(_Layer)),
                ("final_norm", _P), ("cos_table", _P), ("sin_table", _P), ("local_cos_table", _P),
                ("local_sin_table", _P), ("table_positions", _I)] + [(name, _P) for name in SCRATCH]


class _Pool(ctypes.Structure):
    _fields_ = [("data", _P), ("scales", _P), ("format", _I), ("layer_bytes", _I), ("plane_bytes", _I),
                ("scale_layer", _I), ("scale_plane", _I), ("block_size", _I), ("num_slots", _I)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I), ("slots", _P), ("num_seqs", _I), ("seq_info", _P), ("block_tables", _P),
                ("positions", _P)]


class _Layout:
    """A pool as cpu_decode.cpp takes it: the storage of its parts (the pool itself, or a LayeredKVPool's two),
    the first layer of each part (whose route gives that part and the step's metadata in its block ids) and each
    layer's (part, index there). No reference to the pool: it is the key of the cache that holds this."""

    def __init__(self, pools, first_layer: list[int], routes: torch.Tensor):
        self.pools, self.first_layer, self.routes = pools, first_layer, routes


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1") != "0"


class FusedDecode:
    """The model's layers as cpu_decode.cpp takes them (weight pointers, shapes, scratch), built once; `calls`
    counts the steps it ran."""

    def __init__(self, model, layers: list[_Layer]):
        config = model.config
        self._fn = native.load().kv_decode_layers
        self._backend = model.backend  # its attention kernel may be switched off after this is built
        self.num_layers, self.heads, self.kv_heads = config.num_layers, config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        # What owns the memory behind the pointers, held so that replacing a module or a parameter later cannot
        # free it.
        self._held = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                       *[norm.weight.data for norm in _norms(layer) if norm is not None])
                      for layer in model.layers] + [model.norm.weight.data]
        self._layers = (_Layer * len(layers))(*layers)
        self._scratch = self._scratch_buffers(config)
        self._decoder = _Decoder(config.num_layers, config.hidden_size, self.heads, self.kv_heads, self.head_dim,
                                 config.intermediate_size, int(model.layers[0].mlp.gelu),
                                 config.rms_norm_eps, config.attention_scale, self._layers,
                                 model.norm.weight.data_ptr(), *(None,) * 4, 0,
                                 *(self._scratch[name].data_ptr() for name in SCRATCH))
        self._rotary = [r for r in (model.rotary, model.local_rotary) if r is not None]  # the model's, then Gemma's
        self._table_limit = min(config.max_position_embeddings, TABLE_POSITIONS)
        self._set_tables(min(self._table_limit, FIRST_TABLE_POSITIONS))
        self._pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pool -> _Layout, or None: not taken
        self._busy = threading.Lock()  # one step at a time uses the scratch; another runs the per-op path
        self.calls = 0

    @classmethod
    def build(cls, model) -> "FusedDecode | None":
        """For a model packed for the CPU (pack_for_cpu) whose every layer it can run; None otherwise."""
        config = model.config
        if (native.load() is None or model.backend.ops is None or not _rope_runs(model.backend.ops, config.head_dim)
                or not _fp32_vector(model.norm.weight)):
            return None
        layers = [_layer(layer, config, int(model.layer_rotary(i) is not model.rotary))
                  for i, layer in enumerate(model.layers)]
        return None if any(layer is None for layer in layers) else cls(model, layers)

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, meta, pool, select=None) -> torch.Tensor | None:
        """The last layer's output after the model's final norm for the embedded tokens hidden [T, hidden_size],
        their K/V written into every layer of the pool at meta.slot_mapping; None, having done nothing, for a
        step it does not take."""
        rows = hidden.shape[0]
        if not (1 <= rows <= MAX_ROWS and hidden.dtype == torch.float32 and hidden.device.type == "cpu"
                and isinstance(self._backend.attention, CpuAttentionKernel) and meta.query_start == list(range(rows + 1))
                and (select is None or select.keeps_all_rows(rows))):
            return None
        layout = self._pool(pool)
        if layout is None or not self._busy.acquire(blocking=False):
            return None
        try:
            return self._step(hidden, positions, meta, pool, layout)
        finally:
            self._busy.release()

    def _step(self, hidden, positions, meta, pool, layout: "_Layout") -> torch.Tensor:
        rows = hidden.shape[0]
        steps, held = (_Step * len(layout.first_layer))(), []  # held: alive until the call returns
        for i, first in enumerate(layout.first_layer):
            part, _, part_meta = pool.route(first, meta)
            slots = part_meta.slot_mapping.to(torch.int64).contiguous()
            plan = KernelPlan(part_meta.query_start, part_meta.block_tables, part_meta.context_lens, positions,
                              part.block_size, part.num_blocks)
            held += [slots, plan]
            steps[i] = _Step(rows, slots.data_ptr(), plan.num_sequences, plan.seq_info.data_ptr(),
                             plan.block_tables.data_ptr(), plan.positions.data_ptr())
        out = hidden.clone(memory_format=torch.contiguous_format)

        def call():
            return self._fn(out.data_ptr(), ctypes.byref(self._decoder), ctypes.byref(layout.pools),
                            ctypes.byref(steps), len(steps), layout.routes.data_ptr(), torch.get_num_threads())

        status = call()
        if status == NO_TABLE and self._grow_tables(int(positions.max()) + 1):
            status = call()  # the refused call ran nothing
        if status == NO_TABLE:
            return None
        if status == BAD_SLOT:
            raise ValueError(f"slots must lie in [0, {pool.num_slots})")
        if status != 0:
            raise ValueError(f"the fused decode's kernels did not take layer {status - 1}'s arguments")
        self.calls += 1
        return out

    def _set_tables(self, positions: int) -> None:
        self._tables = [rotary.table(positions) for rotary in self._rotary]  # [(cos, sin)], held for the pointers
        pointers = [t.data_ptr() for pair in self._tables for t in pair] + [None, None]
        d = self._decoder
        d.cos_table, d.sin_table, d.local_cos_table, d.local_sin_table = pointers[:4]
        d.table_positions = positions

    def _grow_tables(self, needed: int) -> bool:
        """Tables of at least `needed` positions (doubling, up to the limit); False if that is past the limit."""
        if needed > self._table_limit:
            return False
        positions = self._decoder.table_positions
        while positions < needed:
            positions *= 2
        self._set_tables(min(positions, self._table_limit))
        return True

    def _pool(self, pool) -> "_Layout | None":
        """The pool's storage as cpu_decode.cpp takes it, worked out once per pool; None for a pool it does
        not write (another dtype or shape)."""
        if pool not in self._pools:
            self._pools[pool] = self._layout(pool)
        return self._pools[pool]

    def _layout(self, pool) -> "_Layout | None":
        # A hybrid model's pool (LayeredKVPool) routes each layer to one of its two pools, at an index there.
        routes = [pool.place(layer) for layer in range(self.num_layers)]
        parts = list(dict.fromkeys(part for part, _ in routes))
        pools = [self._part_layout(part, sum(p is part for p, _ in routes)) for part in parts]
        if any(p is None for p in pools):
            return None
        first_layer = [next(layer for layer, (p, _) in enumerate(routes) if p is part) for part in parts]
        return _Layout((_Pool * len(pools))(*pools), first_layer,
                       torch.tensor([[parts.index(p), i] for p, i in routes], dtype=torch.int64).contiguous())

    def _part_layout(self, pool, num_layers: int) -> _Pool | None:
        storage = pool.kernel_storage()
        if (storage is None or pool.dtype not in POOL_FORMATS or not CpuAttentionKernel.takes_pool(pool)
                or (pool.num_layers, pool.num_kv_heads, pool.head_dim) != (num_layers, self.kv_heads,
                                                                          self.head_dim)):
            return None
        data, scales = storage
        size = data.element_size()
        return _Pool(data.data_ptr(), None if scales is None else scales.data_ptr(), POOL_FORMATS[pool.dtype],
                     data.stride(0) * size, data.stride(1) * size, 0 if scales is None else scales.stride(0),
                     0 if scales is None else scales.stride(1), pool.block_size, pool.num_slots)

    def _scratch_buffers(self, config) -> dict[str, torch.Tensor]:
        heads, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        widths = dict(cos=2 * self.head_dim, sin=2 * self.head_dim, normed=config.hidden_size, qkv=heads + 2 * kv_width,
                      qk=heads + kv_width, kv=2 * kv_width, attn=heads, proj=config.hidden_size,
                      gate_up=2 * config.intermediate_size, act=config.intermediate_size)
        return {name: torch.empty(MAX_ROWS, widths[name], dtype=torch.float32) for name in SCRATCH}


def _fp32_vector(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()


def _rope_runs(ops, head_dim: int) -> bool:
    """Whether the native RoPE takes this head_dim on this CPU (the per-op path falls back to torch's)."""
    x, angles = torch.zeros(1, 1, head_dim), torch.zeros(1, head_dim)
    return ops.rope(x, angles, angles) is not None


def _norms(layer) -> tuple:
    """A layer's RMSNorms as the _Layer fields take them, in order (None: the model has no such norm)."""
    attn = layer.self_attn
    sandwich = (layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm) if layer.sandwich else (None, None)
    return (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm, *sandwich)


def _layer(layer, config, rope: int) -> _Layer | None:
    """A decoder layer's weights as cpu_decode.cpp takes them; None for a layer it does not run. rope: 1 if the
    layer rotates with the model's second base (Gemma 3's sliding layers)."""
    attn, mlp = layer.self_attn, layer.mlp
    hidden, heads, kv_heads = config.hidden_size, attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    norms = _norms(layer)
    if not all(_fp32_vector(norm.weight) for norm in norms if norm is not None):
        return None
    products = (_product(attn.qkv_proj, hidden, heads + 2 * kv_heads), _product(attn.o_proj, heads, hidden),
                _product(mlp.gate_up_proj, hidden, 2 * config.intermediate_size),
                _product(mlp.down_proj, config.intermediate_size, hidden))
    if any(p is None for p in products):
        return None
    input_norm, post_norm, q_norm, k_norm, pre_ff, post_ff = (None if n is None else n.weight.data_ptr() for n in norms)
    return _Layer(input_norm, post_norm, *products, attn.sliding_window or 0, q_norm, k_norm, pre_ff, post_ff, rope)


def _product(module, in_features: int, out_features: int) -> _Linear | None:
    """A native product's weights as its kernel takes them, if it has these features."""
    if not isinstance(module, (NativeLinear, NativeQuantLinear)) or \
            (module.in_features, module.out_features) != (in_features, out_features):
        return None
    if isinstance(module, NativeQuantLinear):
        fmt, codes, scales, mins, half_scales, group, bias, n = module.kernel_weights
        return _Linear(fmt, codes, scales, mins, half_scales, group, bias, in_features, n)
    bias = None if module.bias is None else module.bias.data_ptr()
    return _Linear(FP32_PANELS, module.panels.data_ptr(), None, None, 0, 0, bias, in_features, out_features)
