"""Re-RoPE: move post-RoPE keys from the position they were computed at to a new one.

Convention (HF transformers / Llama, "neox" layout): the head dim is split into halves
x1 = x[..., :d/2], x2 = x[..., d/2:], and RoPE at position p is

    rope(x, p) = x * cos(p*f) + rotate_half(x) * sin(p*f),   rotate_half(x) = cat(-x2, x1)

with f = inv_freq (length d/2) repeated twice along the dim. RoPE is a rotation of each
(x1[i], x2[i]) pair by the angle p*f[i], so moving a key from p to q is one more rotation
by q*f[i] - p*f[i].

Precision. The model computes its angles as ``float32(p) * inv_freq`` in float32 (see
``LlamaRotaryEmbedding.forward``), so a key stored at position p was rotated by
fl32(p*f), not by the exact p*f; at p ~ 32k that rounding is up to ~2e-3 rad for the
highest frequency. By default (``match_fp32_angles=True``) we rotate by
fl32(q*f) - fl32(p*f), the difference taken in float64 (exact: both terms are float32),
so the result reproduces the model's own key at q up to float32 rounding of cos/sin and
of the stored key, whatever the positions. With ``match_fp32_angles=False`` the rotation
is by the exact (q-p)*f in float64; that is what ``rerope_dense`` with only a delta does.
Measured against transformers (positions < 32k, fp32, |k| <= 5): max abs error ~1e-6
matched, ~5e-3 exact-delta; fp16/bf16 pools: within ~2 eps*|k| (two roundings).

Per-layer bases. A model's layers need not share one RoPE: Gemma 3's sliding layers rotate
with base 10k, its global ones with 1M. The functions that act on every layer's pool
(:func:`rerope_layers_`, and blend/key_shift.py) take either one inv_freq [d/2] for every
layer or a table [layers, d/2] whose row i is layer i's; rotating a layer's keys by another
layer's frequencies would put them at the wrong position.

Slots passed to the paged functions must be distinct (a slot listed twice would be
rotated twice by the Triton kernel).
"""

from __future__ import annotations

import torch

from blend.rope_checks import check_inv_freq, check_paged_args

Backend = str  # "auto" | "torch" | "triton"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def default_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """inv_freq = 1/theta^(arange(0,d,2)/d) in float32, as transformers computes it."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Reference RoPE of x[N, heads, d] at positions[N], computed like the model (fp32 angles)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    xf = x.to(torch.float32)
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def rotation_angles(
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    match_fp32_angles: bool = True,
) -> torch.Tensor:
    """float64 angles [N, d/2] that rotate a key from old_pos to new_pos."""
    f32 = inv_freq.to(torch.float32)
    if match_fp32_angles:
        a_new = (new_pos.to(torch.float32)[:, None] * f32[None, :]).to(torch.float64)
        a_old = (old_pos.to(torch.float32)[:, None] * f32[None, :]).to(torch.float64)
        return a_new - a_old
    delta = (new_pos.to(torch.int64) - old_pos.to(torch.int64)).to(torch.float64)
    return delta[:, None] * f32.to(torch.float64)[None, :]


def layer_inv_freq(inv_freq: torch.Tensor, num_layers: int) -> torch.Tensor:
    """inv_freq as a [num_layers, d/2] table: a [d/2] vector serves every layer, a table is checked."""
    if inv_freq.dim() == 1:
        return inv_freq.expand(num_layers, -1)
    if inv_freq.dim() != 2 or inv_freq.shape[0] != num_layers:
        raise ValueError(f"inv_freq must be [d/2] or [{num_layers} layers, d/2], got {tuple(inv_freq.shape)}")
    return inv_freq


def per_layer_cos_sin(
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    num_layers: int,
    *,
    match_fp32_angles: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's :func:`rotation_cos_sin` from old_pos to new_pos, computed once per distinct row of the
    inv_freq table (once for a [d/2] vector; twice on Gemma 3), the layers sharing a row sharing it."""
    def cos_sin(f: torch.Tensor):
        return rotation_cos_sin(rotation_angles(old_pos, new_pos, f, match_fp32_angles=match_fp32_angles))

    if inv_freq.dim() == 1:
        return [cos_sin(inv_freq)] * num_layers
    distinct, row_of_layer = torch.unique(layer_inv_freq(inv_freq, num_layers), dim=0, return_inverse=True)
    computed = [cos_sin(f) for f in distinct]
    return [computed[i] for i in row_of_layer.tolist()]


def rotation_cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [N, 1, d/2] of float64 angles [N, d/2], ready for :func:`_rotate`."""
    return torch.cos(angles).to(torch.float32)[:, None, :], torch.sin(angles).to(torch.float32)[:, None, :]


def _rotate(x: torch.Tensor, angles: torch.Tensor | None = None, cos_sin=None) -> torch.Tensor:
    """Rotate x[N, H, d] (any float dtype) by angles[N, d/2] (float64) or by precomputed
    ``cos_sin``; math in fp32, result in x's dtype."""
    cos, sin = rotation_cos_sin(angles) if cos_sin is None else cos_sin
    xf = x.to(torch.float32)
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rerope_dense(
    k: torch.Tensor,
    delta_pos: torch.Tensor | int,
    inv_freq: torch.Tensor,
    *,
    old_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return k[N, kvh, hd] moved by delta_pos (tensor [N] or int) positions.

    Without ``old_pos`` the rotation is by the exact delta*inv_freq. With ``old_pos`` the
    new position is old_pos + delta_pos and the model's fp32 angle rounding is matched.
    """
    if k.dim() != 3:
        raise ValueError(f"k must be [N, kvh, hd], got shape {tuple(k.shape)}")
    n, _, hd = k.shape
    check_inv_freq(inv_freq, hd)
    delta = torch.as_tensor(delta_pos, dtype=torch.int64, device=k.device).expand(n)
    if old_pos is None:
        zeros = torch.zeros(n, dtype=torch.int64, device=k.device)
        angles = rotation_angles(zeros, delta, inv_freq.to(k.device), match_fp32_angles=False)
    else:
        old = old_pos.to(device=k.device, dtype=torch.int64)
        angles = rotation_angles(old, old + delta, inv_freq.to(k.device))
    return _rotate(k, angles)


def rerope_torch_(
    k_cache: torch.Tensor,
    slots: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    match_fp32_angles: bool = True,
) -> None:
    """Torch implementation of :func:`rerope_` (gather, rotate in fp32, scatter back)."""
    rerope_layers_([k_cache], slots, old_pos, new_pos, inv_freq, backend="torch",
                   match_fp32_angles=match_fp32_angles)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def rerope_(
    k_cache: torch.Tensor,
    slots: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    backend: Backend = "auto",
    match_fp32_angles: bool = True,
) -> None:
    """In place on the paged pool: move the keys at ``slots`` from old_pos to new_pos.

    k_cache: [num_blocks, block_size, kvh, hd] post-RoPE keys (fp32/fp16/bf16); a token
    at slot s is ``k_cache.view(-1, kvh, hd)[s]``. slots/old_pos/new_pos: int [N] on the
    same device, slots distinct. inv_freq: [hd/2] (float32, as the model uses it).
    backend "auto" uses the Triton kernel for CUDA tensors when triton imports, else torch.
    """
    rerope_layers_([k_cache], slots, old_pos, new_pos, inv_freq, backend=backend,
                   match_fp32_angles=match_fp32_angles)


def rerope_layers_(
    k_caches: "list[torch.Tensor] | tuple[torch.Tensor, ...]",
    slots: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    backend: Backend = "auto",
    match_fp32_angles: bool = True,
) -> None:
    """:func:`rerope_` on the same slots of every layer's pool (a reused chunk is moved in
    all layers at once). inv_freq: [hd/2] for every layer, or [layers, hd/2], row i being
    layer i's (per-layer RoPE bases, see the module's docstring). The torch path computes
    cos/sin once per distinct row for all the layers that share it."""
    if not k_caches:
        return
    table = layer_inv_freq(inv_freq, len(k_caches))
    if backend == "auto":
        backend = "triton" if k_caches[0].is_cuda and triton_available() else "torch"
    if backend == "triton":
        from blend.rope_triton import rerope_triton_

        for k_cache, layer_freq in zip(k_caches, table):
            rerope_triton_(k_cache, slots, old_pos, new_pos, layer_freq, match_fp32_angles=match_fp32_angles)
        return
    if backend != "torch":
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    for k_cache, layer_freq in zip(k_caches, table):
        check_paged_args(k_cache, slots, old_pos, new_pos, layer_freq)
    if slots.numel() == 0:
        return
    idx = slots.to(torch.int64)
    cos_sins = per_layer_cos_sin(old_pos, new_pos, inv_freq, len(k_caches), match_fp32_angles=match_fp32_angles)
    for k_cache, cos_sin in zip(k_caches, cos_sins):
        _, _, kvh, hd = k_cache.shape
        flat = k_cache.view(-1, kvh, hd)
        flat.index_copy_(0, idx, _rotate(flat.index_select(0, idx), cos_sin=cos_sin))
