"""The subset of a Hugging Face config.json that the Llama-family forward pass needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}
# transformers' names of the gated MLP's activation: SiLU, and GeGLU with the tanh approximation of GELU
SUPPORTED_ACTIVATIONS = {"silu", "gelu_pytorch_tanh"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # the RoPE base of the full-attention layers (of every layer, unless local_rope_theta)
    rope_scaling: dict | None  # None for plain RoPE; else {"rope_type": "llama3" | "linear", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2; Llama configs with attention_bias=True)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    architecture: str  # HF model_type, one of SUPPORTED_ARCHITECTURES
    sliding_window: int | None = None  # the sliding layers' window: a key is visible iff query_pos - key_pos < it
    o_proj_bias: bool = False  # Llama and Qwen3 with attention_bias=True bias o_proj too; Qwen2 never does
    layer_windows: tuple[int | None, ...] = ()  # each layer's window (None: the whole context); () none slide
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base (plain RoPE)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale query_pre_attn_scalar^-0.5, not head_dim's
    embedding_multiplier: float = 1.0  # Gemma: embeddings scaled by sqrt(hidden_size)
    hidden_act: str = "silu"
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    sandwich_norms: bool = False  # Gemma: norms after attention and the MLP too (before the residual add)
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm multiplies by (offset + weight); added once at load

    def layer_window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of a layer: Gemma 3's sliding layers rotate with a base of their own."""
        if self.local_rope_theta is not None and self.layer_window(layer) is not None:
            return self.local_rope_theta
        return self.rope_theta

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict, in either the transformers 4 (rope_theta + rope_scaling)
        or the transformers 5 (rope_parameters) layout."""
        arch = hf.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported model_type {arch!r}; this engine runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = arch == "gemma3_text"
        act = hf.get("hidden_activation" if gemma else "hidden_act") or hf.get("hidden_act") or "silu"
        if act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(f"unsupported activation {act!r}; implemented: {sorted(SUPPORTED_ACTIVATIONS)}")
        if hf.get("mlp_bias", False):
            raise ModelLoadError("mlp_bias=True is not implemented")
        for field in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(field) is not None:
                raise ModelLoadError(f"{field} is not implemented")
        if hf.get("use_bidirectional_attention"):
            raise ModelLoadError("use_bidirectional_attention is not implemented (a decoder attends causally)")

        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope_settings(hf)
        # Qwen2 always has q/k/v biases (never o) and its config carries no attention_bias key;
        # Mistral never has any; Llama's, Qwen3's and Gemma's attention_bias covers q, k, v and o.
        attention_bias = {"qwen2": True, "mistral": False}.get(arch, bool(hf.get("attention_bias", False)))
        o_proj_bias = arch in ("llama", "qwen3", "gemma3_text") and attention_bias
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if "chunked_attention" in (hf.get("layer_types") or ()):
            raise ModelLoadError("chunked attention (Llama 4) is not implemented")
        windows = layer_windows(hf)
        sliding = {w for w in windows if w is not None}
        if len(sliding) > 1:
            raise ModelLoadError(f"sliding layers with different windows {sorted(sliding)} are not implemented")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            sliding_window=sliding.pop() if sliding else None,
            o_proj_bias=o_proj_bias,
            layer_windows=windows if any(w is not None for w in windows) else (),
            local_rope_theta=_local_rope_theta(hf) if gemma else None,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)) if gemma else None,
            embedding_multiplier=float(hf["hidden_size"]) ** 0.5 if gemma else 1.0,
            hidden_act=act,
            qk_norm=arch in ("qwen3", "gemma3_text"),
            sandwich_norms=gemma,
            norm_weight_offset=1.0 if gemma else 0.0,
        )


def _rope_settings(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """The full-attention layers' RoPE base and scaling (Gemma 3's sliding layers: _local_rope_theta)."""
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params:  # per-layer-type layout (transformers 5 for Gemma 3, Qwen3, ...)
        params = dict(params["full_attention"] or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    # Gemma 3's global layers default to a base of 1e6; every other family's to 1e4
    default_theta = 1_000_000.0 if hf.get("model_type") == "gemma3_text" else 10000.0
    theta = float(params.pop("rope_theta", hf.get("rope_theta", default_theta)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r}; implemented: {sorted(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial_rotary_factor != 1 is not implemented")
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _local_rope_theta(hf: dict[str, Any]) -> float:
    """Gemma 3's sliding layers: plain RoPE with their own base (rope_local_base_freq in transformers 4)."""
    params = dict((hf.get("rope_parameters") or {}).get("sliding_attention") or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ModelLoadError(f"rope type {rope_type!r} on the sliding layers is not implemented")
    return float(params.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))


# Model families whose config.json leaves the local/global layer pattern implicit, as transformers fills it in:
# every n-th layer global (sliding_window_pattern), or sliding from layer max_window_layers on.
_WINDOW_PATTERN_DEFAULTS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
_SLIDING_FROM_MAX_WINDOW_LAYERS = {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def layer_windows(hf: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's attention window (None: the whole context), as transformers reads config.json: an explicit
    `layer_types` list, else the family's pattern (_WINDOW_PATTERN_DEFAULTS, Qwen's max_window_layers), else
    `sliding_window` on every layer (Mistral). A chunked-attention layer (Llama 4) never looks back further than
    `attention_chunk_size` tokens, so it counts as a window of that size."""
    num_layers = hf["num_hidden_layers"]
    arch = hf.get("model_type", "")
    window = hf.get("sliding_window")
    use_window = hf.get("use_sliding_window", arch not in _SLIDING_FROM_MAX_WINDOW_LAYERS)  # Qwen: off by default
    if not use_window:
        window = None
    types = hf.get("layer_types")
    if types is None:
        if window is None:
            return (None,) * num_layers
        if arch in _SLIDING_FROM_MAX_WINDOW_LAYERS:
            first = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        elif "sliding_window_pattern" in hf or arch in _WINDOW_PATTERN_DEFAULTS:
            every = int(hf.get("sliding_window_pattern") or _WINDOW_PATTERN_DEFAULTS[arch])
            types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)]
        else:
            types = ["sliding_attention"] * num_layers
    if len(types) != num_layers or not set(types) <= _LAYER_TYPES:
        raise ModelLoadError(f"layer_types must list one of {sorted(_LAYER_TYPES)} for each of the "
                             f"{num_layers} layers, got {types!r}")
    windows = {"full_attention": None, "sliding_attention": window,
               "chunked_attention": hf.get("attention_chunk_size")}
    if "sliding_attention" in types and window is None:
        windows["sliding_attention"] = None  # sliding layers with no window set (Qwen with it switched off)
    return tuple(None if windows[t] is None else int(windows[t]) for t in types)
