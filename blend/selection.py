"""CacheBlend token selection: recompute the tokens whose reused KV deviates most.

At a check layer the engine has, for every candidate token, the stale KV (from the chunk
cache, re-RoPE'd to the token's new position) and the fresh KV computed in this request's
context. The tokens with the largest deviation keep being recomputed in later layers;
the others keep their reused KV. With gradual filtering (CacheBlend section 4.3) the set
shrinks at each further check layer: all tokens are computed up to the first check layer,
then ceil(r1*N) of them up to the next, then ceil(r2*N), ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_SCORES = ("k", "v", "kv")
# ratio*n is computed in binary floating point (0.1*30 = 3.0000000000000004); a count
# within this distance of an integer is taken as that integer before ceil.
_RATIO_SLACK = 1e-9


def _sq_dev(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    if old.shape != new.shape:
        raise ValueError(f"shape mismatch: {tuple(old.shape)} vs {tuple(new.shape)}")
    if old.dim() < 1:
        raise ValueError("KV tensors need a leading token dim")
    diff = new.to(torch.float32) - old.to(torch.float32)
    return diff.square().reshape(diff.shape[0], -1).sum(dim=1)


def kv_deviation(
    old_k: torch.Tensor | None,
    new_k: torch.Tensor | None,
    old_v: torch.Tensor | None = None,
    new_v: torch.Tensor | None = None,
    score: str = "k",
) -> torch.Tensor:
    """Per-token deviation [N] (float32) between stale and fresh KV ([N, kvh, hd] or [N, ...]).

    "k"/"v": sum over heads and dims of the squared difference of K (resp. V); "k" is what
    LMCache's CacheBlend uses, on post-RoPE keys (compare both at the same position).
    "kv": dev_k / mean(dev_k) + dev_v / mean(dev_v), i.e. each term is scaled to mean 1
    over the tokens so that neither K's nor V's magnitude dominates the ranking; a term
    whose mean is 0 (nothing deviates) contributes 0.
    """
    if score not in _SCORES:
        raise ValueError(f"score must be one of {_SCORES}, got {score!r}")
    need_k, need_v = score in ("k", "kv"), score in ("v", "kv")
    if need_k and (old_k is None or new_k is None):
        raise ValueError(f"score={score!r} needs old_k and new_k")
    if need_v and (old_v is None or new_v is None):
        raise ValueError(f"score={score!r} needs old_v and new_v")
    if score == "k":
        return _sq_dev(old_k, new_k)
    if score == "v":
        return _sq_dev(old_v, new_v)
    dk, dv = _sq_dev(old_k, new_k), _sq_dev(old_v, new_v)
    if dk.shape != dv.shape:
        raise ValueError("K and V must have the same number of tokens")
    return _unit_mean(dk) + _unit_mean(dv)


def _unit_mean(dev: torch.Tensor) -> torch.Tensor:
    if dev.numel() == 0:
        return dev
    mean = dev.mean()
    return torch.where(mean > 0, dev / mean.clamp_min(torch.finfo(dev.dtype).tiny), torch.zeros_like(dev))


def query_attention(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention mass [N] each of N keys receives from the queries: per query and head, softmax over the
    keys at positions <= the query's, then averaged over heads and summed over queries.

    q: [Q, heads, hd] (post-RoPE), k: [N, kv_heads, hd] (post-RoPE); heads a multiple of kv_heads (GQA:
    query head h reads KV head h // (heads // kv_heads), as transformers' repeat_kv lays them out).
    """
    nq, heads, hd = q.shape
    n, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads")
    scores = torch.einsum("qkgd,nkd->kgqn", q.float().view(nq, kv_heads, heads // kv_heads, hd), k.float()) * scale
    visible = k_pos.to(q.device)[None, :] <= q_pos.to(q.device)[:, None]  # [Q, N]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees no key contributes nothing
    return probs.sum(dim=(0, 1, 2)) / heads


def combine_scores(deviation: torch.Tensor, attention: torch.Tensor, weight: float) -> torch.Tensor:
    """deviation and attention mass, each scaled to mean 1 over the tokens, summed with `weight` on attention."""
    if deviation.shape != attention.shape:
        raise ValueError("deviation and attention must score the same tokens")
    return _unit_mean(deviation.float()) + weight * _unit_mean(attention.float())


def count_for_ratio(ratio: float, n: int) -> int:
    """ceil(ratio*n) for ratio in [0, 1]; 0 -> 0, 1 -> n."""
    if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    return min(n, max(0, math.ceil(ratio * n - _RATIO_SLACK)))


def select_top_k(deviation: torch.Tensor, k: int, always: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (int64, ascending) of the k largest deviations plus every ``always`` token.

    The k are chosen among the tokens NOT marked ``always`` (the marked ones come on top
    of the budget), capped by how many such tokens there are. Ties go to the lower index;
    NaN ranks above every number (a broken score is recomputed rather than trusted).
    """
    if deviation.dim() != 1:
        raise ValueError(f"deviation must be 1-D, got shape {tuple(deviation.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    n = deviation.shape[0]
    dev = torch.nan_to_num(deviation.to(torch.float32), nan=math.inf)
    if always is not None:
        if always.shape != (n,) or always.dtype != torch.bool:
            raise ValueError(f"always must be a bool tensor of shape ({n},)")
        always = always.to(dev.device)
        dev = dev.masked_fill(always, -math.inf)
        k = min(k, n - int(always.sum()))
    k = min(k, n)
    order = torch.sort(dev, descending=True, stable=True).indices[:k]
    chosen = torch.zeros(n, dtype=torch.bool, device=dev.device)
    chosen[order] = True
    if always is not None:
        chosen |= always
    return chosen.nonzero(as_tuple=True)[0]


def select_top(deviation: torch.Tensor, ratio: float, always: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the top ceil(ratio*N) deviations (see :func:`select_top_k`), N = len(deviation)."""
    return select_top_k(deviation, count_for_ratio(ratio, deviation.shape[0]), always)


@dataclass(frozen=True)
class GradualSchedule:
    """Gradual filtering: at check_layers[i] keep ceil(ratios[i]*N) of the N blended tokens.

    Layer 0 cannot be a check layer: its KV depends only on token and position, so the
    stale and fresh KV agree there and there is nothing to select on.
    """

    check_layers: tuple[int, ...]
    ratios: tuple[float, ...]

    def __init__(self, check_layers: list[int], ratios: list[float]):
        layers, rs = tuple(int(x) for x in check_layers), tuple(float(r) for r in ratios)
        if not layers:
            raise ValueError("a schedule needs at least one check layer")
        if len(layers) != len(rs):
            raise ValueError(f"{len(layers)} check layers but {len(rs)} ratios")
        if layers[0] < 1:
            raise ValueError(f"check layers must be >= 1 (layer 0 cannot select), got {layers[0]}")
        if any(b <= a for a, b in zip(layers, layers[1:])):
            raise ValueError(f"check layers must be strictly increasing, got {list(layers)}")
        for r in rs:
            if math.isnan(r) or not 0.0 <= r <= 1.0:
                raise ValueError(f"ratios must be in [0, 1], got {r}")
        if any(b > a for a, b in zip(rs, rs[1:])):
            raise ValueError(f"ratios must be non-increasing, got {list(rs)}")
        object.__setattr__(self, "check_layers", layers)
        object.__setattr__(self, "ratios", rs)

    def validate_for(self, num_layers: int) -> None:
        if self.check_layers[-1] >= num_layers:
            raise ValueError(f"check layer {self.check_layers[-1]} >= num_layers {num_layers}")

    def is_check_layer(self, layer: int) -> bool:
        return layer in self.check_layers

    def ratio_at(self, layer: int) -> float:
        """Fraction of the blended tokens recomputed at ``layer`` (1.0 up to the first check)."""
        ratio = 1.0
        for check, r in zip(self.check_layers, self.ratios):
            if layer > check:
                ratio = r
        return ratio

    def keep_count(self, layer: int, n_tokens: int) -> int:
        """How many of the n_tokens blended tokens are recomputed at ``layer``.

        All of them up to and including the first check layer (their fresh KV is what the
        check compares), then ceil(r_i*N) after check layer i, non-increasing by construction.
        """
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        return count_for_ratio(self.ratio_at(layer), n_tokens)

    def selection_count(self, layer: int, n_tokens: int) -> int:
        """At a check layer, how many tokens to keep for the following layers."""
        if not self.is_check_layer(layer):
            raise ValueError(f"layer {layer} is not a check layer of {self}")
        return count_for_ratio(self.ratios[self.check_layers.index(layer)], n_tokens)


def first_tokens_mask(
    chunk_starts: list[int] | torch.Tensor,
    chunk_lens: list[int] | torch.Tensor,
    k: int | list[int],
    total: int | None = None,
) -> torch.Tensor:
    """Bool mask [total] marking the first min(k, len) tokens of each chunk (k: one count for every chunk,
    or one per chunk).

    (EPIC's LegoLink observation: a chunk cached alone makes its first tokens an attention
    sink, so they are the ones to recompute; blend/strategies.py's ChunkStarts.)
    ``total`` defaults to the end of the last chunk.
    """
    starts = [int(s) for s in chunk_starts]
    lens = [int(n) for n in chunk_lens]
    ks = [int(k)] * len(starts) if isinstance(k, int) else [int(x) for x in k]
    if len(starts) != len(lens) or len(ks) != len(starts):
        raise ValueError("chunk_starts, chunk_lens and per-chunk k differ in length")
    if any(x < 0 for x in ks) or any(s < 0 for s in starts) or any(n < 0 for n in lens):
        raise ValueError("k, starts and lens must be >= 0")
    end = max((s + n for s, n in zip(starts, lens)), default=0)
    if total is None:
        total = end
    elif total < end:
        raise ValueError(f"total {total} < end of last chunk {end}")
    mask = torch.zeros(total, dtype=torch.bool)
    for s, n, kk in zip(starts, lens, ks):
        mask[s : s + min(kk, n)] = True
    return mask
