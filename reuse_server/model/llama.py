"""A Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3, Gemma 3) over the paged KV pool.

The families differ in switches of ModelConfig, read here: q/k norms (Qwen3, Gemma 3), norms after attention
and the MLP (Gemma), GeGLU, scaled embeddings and attention, and per layer a window and a RoPE base (Gemma 3's
sliding layers). Parameter names follow transformers' checkpoints with the leading "model." removed, so a
safetensors state dict loads by name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from . import cpu_attention, cpu_ops, fused_decode, quant_linear
from .cpu_backend import CpuBackend
from .cpu_linear import NativeLinear, pack_linear_layers, packer
from .rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, backend: CpuBackend | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = backend or CpuBackend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.backend.ops
        if ops is not None and ops.takes(x) and self.weight.dtype == torch.float32:
            return ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op instead of six; the same arithmetic
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # In fp32 whatever the model dtype, then back, as transformers' LlamaRMSNorm does.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: CpuBackend | None = None, layer_idx: int = 0):
        super().__init__()
        self.backend = backend or CpuBackend()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.layer_window(layer_idx)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_proj_bias)
        self.qkv_proj = None  # q/k/v in one packed product once pack_qkv_for_cpu ran (q_proj... are then None)
        if config.qk_norm:  # over each head's head_dim, before RoPE
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, self.backend)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, self.backend)
        else:
            self.q_norm = self.k_norm = None

    def pack_qkv_for_cpu(self, kind: str = "native") -> int:
        """Replace q_proj, k_proj and v_proj by one packed product of their stacked weights: one call instead
        of three (k's and v's few outputs alone split unevenly over the threads; BENCHMARKS.md, "CPU kernel
        choices"). Returns how many linear layers it replaced (0 or 3)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if not all(isinstance(p, nn.Linear) for p in projections):
            return 0
        cls = packer(self.q_proj.weight, kind)
        if cls is None:
            return 0
        self.qkv_proj = cls.stacked(projections)
        self.q_proj = self.k_proj = self.v_proj = None
        return len(projections)

    def _project(self, hidden):
        """The tokens' queries and keys side by side, [T, heads + kv_heads, head_dim], and values,
        [T, kv_heads, head_dim]; before RoPE (one rotation then serves queries and keys)."""
        t, hd = hidden.shape[0], self.head_dim
        if self.qkv_proj is not None:
            qk, v = self.qkv_proj(hidden).split([(self.num_heads + self.num_kv_heads) * hd, self.num_kv_heads * hd], -1)
        else:
            qk, v = torch.cat([self.q_proj(hidden), self.k_proj(hidden)], -1), self.v_proj(hidden)
        qk = qk.view(t, self.num_heads + self.num_kv_heads, hd)
        if self.q_norm is not None:
            q, k = qk[:, :self.num_heads].reshape(-1, hd), qk[:, self.num_heads:].reshape(-1, hd)
            qk = torch.cat([self.q_norm(q).view(t, -1, hd), self.k_norm(k).view(t, -1, hd)], 1)
        return qk, v.view(t, self.num_kv_heads, hd)

    def forward(self, hidden, positions, meta: AttentionMetadata, pool, layer_idx: int, rotary: RotaryEmbedding,
                select: "RowSelection | None" = None):
        """Writes every token's K/V; then attends for the rows `select` keeps (all without one). Returns the
        attention output [rows, hidden], the rows kept (ascending indices into the T tokens; None: all), and
        those rows' positions and metadata (built once here, shared by the later layers)."""
        qk, v = self._project(hidden)
        qk = _rotate(qk, positions, meta, rotary, self.backend.ops)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        rows = select.rows(layer_idx, q, k, v, meta) if select is not None else None  # sees the stale K/V
        # A hybrid model's pool keeps full-attention and window layers apart, each with block ids of its own:
        # the layer's pool, its index there and the step in its ids.
        layer_pool, index, layer_meta = pool.route(layer_idx, meta)
        layer_pool.write(index, layer_meta.slot_mapping, k, v)  # before attending: the tokens see their own fresh K/V
        if rows is not None:
            host_rows, rows = rows, rows.to(q.device, non_blocking=True)
            q, positions, meta = q[rows], positions[rows], meta.subset(host_rows, rows)
            layer_pool, index, layer_meta = pool.route(layer_idx, meta)
        t = q.shape[0]
        kernel = self.backend.attention
        if kernel is not None and kernel.takes(q, layer_pool):
            plan = layer_meta.kernel_plan(positions, lambda: kernel.plan(
                layer_meta, positions, layer_pool, self.num_heads))
            out = kernel(q, plan, layer_pool, index, self.scale, self.sliding_window)
        else:
            masks = layer_meta.sequence_masks(positions, self.sliding_window, q.dtype)
            out = paged_attention(q, layer_meta, masks, layer_pool, index, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim)), rows, positions, meta


def _rotate(x, positions, meta: AttentionMetadata, rotary: RotaryEmbedding, ops=None):
    """RoPE at `positions`, with cos/sin computed once per forward pass and shared by every layer of that base;
    through the native kernel where it takes them (one call instead of torch's five ops; the same values)."""
    cos, sin = meta.cached(positions, ("rope", x.dtype, rotary.theta), lambda: rotary.cos_sin(positions, x.dtype))
    rotated = ops.rope(x, cos, sin) if ops is not None else None
    return rotated if rotated is not None else apply_rotary(x, cos, sin)


# A step's MLP activations grow with its rows (the stacked gate/up output of 8,192 SmolLM2 rows is 96 MiB) and
# glibc keeps much of what a step frees: the MLP runs at most this many rows at a time, which bounds them. Each
# row's products do not depend on the rows beside it, so the result is the same, and a product of this many
# rows runs as fast per row as a taller one.
MLP_ROWS = 2048


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, backend: CpuBackend | None = None):
        super().__init__()
        self.backend = backend or CpuBackend()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj = None  # gate and up as one native product once packed (gate/up_proj then None)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma), else SiLU gating
        self.hidden_size = config.hidden_size

    def pack_gate_up(self) -> int:
        """Gate and up projections as one native product of their stacked weights, gated by one native pass
        (the native kernel's panels make the stacked product cost what the two did; oneDNN's stacked product ran
        a cold prefill's rows slower, so it keeps two). Returns how many linear layers it replaced."""
        if not (isinstance(self.gate_proj, nn.Linear) and isinstance(self.up_proj, nn.Linear)):
            return 0
        if self.backend.ops is None or packer(self.gate_proj.weight, "native") is not NativeLinear:
            return 0
        self.gate_up_proj = NativeLinear.stacked([self.gate_proj, self.up_proj])
        self.gate_proj = self.up_proj = None
        return 2

    def forward(self, x):
        if x.shape[0] <= MLP_ROWS:
            return self._rows(x)
        out = x.new_empty(x.shape[0], self.hidden_size)
        for start in range(0, x.shape[0], MLP_ROWS):
            out[start:start + MLP_ROWS] = self._rows(x[start:start + MLP_ROWS])
        return out

    def _rows(self, x):
        if self.gate_up_proj is not None:  # stacked: natively packed, or int weights (quant_linear packs them so)
            gate_up = self.gate_up_proj(x)
            ops = self.backend.ops
            if ops is not None and ops.takes(gate_up) and gate_up.is_contiguous():  # one native gating pass
                return self.down_proj(ops.gelu_mul(gate_up) if self.gelu else ops.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self._act(gate) * up)
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))

    def _act(self, gate):
        return F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 backend: CpuBackend | None = None):
        super().__init__()
        backend = backend or CpuBackend()
        self.layer_idx = layer_idx
        self.self_attn = Attention(config, backend, layer_idx)
        self.mlp = MLP(config, backend)
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, backend)  # noqa: E731
        self.input_layernorm = norm()
        # Llama: the MLP's input norm. Gemma: the attention output's norm, and two more around the MLP.
        self.post_attention_layernorm = norm()
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        # Shared, not owned: a plain attribute keeps it out of this layer's state dict.
        self.__dict__["rotary"] = rotary

    def forward(self, hidden, positions, meta: AttentionMetadata, pool, layer_idx: int | None = None,
                select: "RowSelection | None" = None):
        """hidden [T, hidden] -> (hidden, positions, meta) of the rows that go on (all T, or those `select`
        keeps: only they run attention and the MLP), residuals included. Writes this layer's K/V of all T
        tokens at meta.slot_mapping."""
        idx = self.layer_idx if layer_idx is None else layer_idx
        attended, rows, positions, meta = self.self_attn(self.input_layernorm(hidden), positions, meta, pool, idx,
                                                         self.rotary, select)
        if rows is not None:
            hidden = hidden[rows]
        if self.sandwich:
            hidden = hidden + self.post_attention_layernorm(attended)
            return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden))), \
                positions, meta
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), positions, meta


class RowSelection:
    """Which of a forward's tokens each layer computes: the one forward serves prefill, decode, prefill
    slices and blending, and blending only chooses rows. At every layer every current token's K/V is written;
    `rows` may then keep some of them for that layer's attention and MLP, and later layers see only those."""

    def keeps_all_rows(self, num_rows: int) -> bool:
        """Whether every layer keeps all of the forward's num_rows tokens, known before it runs: the forward
        may then run its layers without asking each (fused_decode). False unless a selection knows it."""
        return False

    def rows(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> torch.Tensor | None:
        """Called after the layer projected and rotated the current tokens' q [T, heads, d], k and v [T,
        kv_heads, d], before it writes k/v to the pool (whose slots, meta.slot_mapping, still hold the old
        K/V). Returns ascending indices into the T tokens, on the host (a CPU tensor: the layer plans the
        rows' attention from them there, and moves them to the device once), or None to keep them all."""
        return None


class OutputRows(RowSelection):
    """Every layer computes every token, except the last, which goes on only for the rows whose logits are
    wanted (their K/V is still written)."""

    def __init__(self, rows: torch.Tensor, num_layers: int):
        self.output_rows = rows
        self.last_layer = num_layers - 1

    def rows(self, layer, q, k, v, meta):
        return self.output_rows if layer == self.last_layer else None

    def keeps_all_rows(self, num_rows):
        return self.output_rows.tolist() == list(range(num_rows))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config)  # the full-attention layers' (every layer's, but on Gemma 3)
        # Gemma 3's sliding layers rotate with a base of their own: one more RotaryEmbedding, shared by them
        self.local_rotary = (RotaryEmbedding(config, theta=config.local_rope_theta)
                             if config.local_rope_theta is not None else None)
        self.backend = CpuBackend()  # shared by every module; written here only (pack_for_cpu, use_cpu_attention_kernel)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.layer_rotary(i), self.backend)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.backend)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.__dict__["packed_head"] = None  # see pack_for_cpu

    def layer_rotary(self, layer: int) -> RotaryEmbedding:
        """The RoPE a layer's K is stored with (blending must re-rotate each layer's K with its own)."""
        uses_local = self.local_rotary is not None and self.config.layer_window(layer) is not None
        return self.local_rotary if uses_local else self.rotary

    def reset_rotary(self, device: torch.device | str) -> None:
        """Recompute every inv_freq on `device` (after the model was built on the meta device)."""
        self.rotary.reset(device)
        if self.local_rotary is not None:
            self.local_rotary.reset(device)

    def pack_for_cpu(self, kind: str = "native", activations: str = "fp32") -> int:
        """Run the linear layers and the output head on weights packed once (see cpu_linear: the native kernel
        in fp32, oneDNN), each attention's q/k/v projections as one, and decode steps' layers in one native
        call where they can (use_fused_decode). After this the model is for inference only: its state dict no
        longer holds the linear weights. Returns the number of linear layers packed (0 where it does not apply:
        GPU, fp16, kind "torch"). activations="int8" runs int8/int4 weights' products on int8 activations
        (quant_linear.NativeQuantLinear)."""
        packed = self._pack_linear_layers(kind, activations)
        self.use_fused_decode()
        return packed

    def _pack_linear_layers(self, kind: str, activations: str) -> int:
        if quant_linear.holds_quantized(self):  # weights held in fewer bits (--weight-dtype): their own kernels
            return quant_linear.pack_quantized(self, kind, activations)
        if activations != "fp32":
            raise ValueError(f"{activations} activations need int8 or int4 weights (--weight-dtype)")
        head = packer(self.embed_tokens.weight, kind)
        if head is None:
            return 0
        packed = sum(layer.self_attn.pack_qkv_for_cpu(kind) for layer in self.layers)
        if kind == "native" and head is NativeLinear:  # fp32 with the kernels built: norms and gating too
            self.backend.ops = cpu_ops.load()
            packed += sum(layer.mlp.pack_gate_up() for layer in self.layers)
        packed += pack_linear_layers(self, kind)  # an untied lm_head is an nn.Linear: packed here
        if self.lm_head is None and self.packed_head is None:
            self.use_packed_head(head(self.embed_tokens.weight))
            packed += 1
        if packed:
            # Weights loaded from safetensors are views of the file's memory map; while any of them is
            # alive the whole map stays resident next to the packed copies. Copy the rest out to release it.
            with torch.no_grad():
                for param in self.parameters():
                    param.data = param.data.clone()
        return packed

    def use_packed_head(self, head: nn.Module) -> None:
        """The output head of a tied-embedding model as its own packed product (the embedding table stays
        for lookups). A plain attribute: not a submodule, not in the state dict."""
        self.__dict__["packed_head"] = head

    def use_cpu_attention_kernel(self, enable: bool = True) -> bool:
        """Attend through the CPU kernel (cpu_attention) wherever it takes the tensors (fp32 on the CPU), or,
        with enable=False, through torch. Returns whether the kernel is in use; False where it cannot be
        built (`native.failure()` says why)."""
        self.backend.attention = cpu_attention.load() if enable else None
        return self.backend.attention is not None

    def use_triton_attention(self, splits: int | None = None, block_n: int | None = None) -> None:
        """Attend through the paged Triton kernel (attention_triton) wherever it takes the tensors: on CUDA,
        or on the CPU in Triton's interpreter. The fused CPU decode attends through the C++ kernel, so it
        steps aside (use_fused_decode). splits, block_n: see TritonAttentionKernel (tests)."""
        from .attention_triton import TritonAttentionKernel  # imports triton: only where asked for

        self.backend.attention = TritonAttentionKernel(splits, block_n)

    def use_fused_decode(self, enable: bool | None = None) -> bool:
        """Run the layers of a decode step in one native call (fused_decode: the same kernels, the same bits)
        where it takes the step, or, with enable=False, always through the per-op path; None: unless
        KV_REUSE_FUSED_DECODE=0. Returns whether it is in use: False for a model it cannot run (not packed for
        the CPU's native kernels, or a family switch it does not implement)."""
        if enable is None:
            enable = fused_decode.enabled_by_env()
        self.backend.decode = fused_decode.FusedDecode.build(self) if enable else None
        return self.backend.decode is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:  # rounded to the model's dtype first, as transformers does
            hidden = hidden * torch.tensor(self.config.embedding_multiplier).to(hidden.dtype)
        return hidden

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    def compute_logits(self, hidden_after_norm: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 [N, vocab]. Call it only on the rows that need logits (e.g. last tokens)."""
        if self.packed_head is not None:
            return self.packed_head(hidden_after_norm).float()
        if self.lm_head is not None:
            return self.lm_head(hidden_after_norm).float()
        return F.linear(hidden_after_norm, self.embed_tokens.weight).float()

    def forward(self, input_ids, positions, meta: AttentionMetadata, pool, select: RowSelection | None = None
                ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final-normed hidden states of the rows that come out of the
        last layer: all T, or those `select` keeps."""
        hidden = self.embed(input_ids)
        decode = self.backend.decode
        fused = decode.run(hidden, positions, meta, pool, select) if decode is not None else None
        if fused is not None:  # the final norm included
            return fused
        for i, layer in enumerate(self.layers):
            hidden, positions, meta = layer(hidden, positions, meta, pool, i, select)
        return self.final_norm(hidden)
