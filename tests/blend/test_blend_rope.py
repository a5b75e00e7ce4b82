"""re-RoPE: rotating a post-RoPE key from p to q must give the model's own key at q.

The reference is transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb. Measured
(positions up to 32k, |k| <= ~5, fp32, default and llama3-scaled inv_freq, hd 64/128):
max |rerope(k_p, p->q) - hf(k, q)| ~1e-6 with the default fp32-angle matching, ~5e-3
when rotating by the exact float64 (q-p)*inv_freq instead (the model's own fp32 angle
rounding at 32k is ~2e-3 rad). Tolerances below have ~10x margin over those figures.

The Triton kernel is compared with the torch path in a subprocess run with
TRITON_INTERPRET=1: triton reads that variable when a kernel is decorated (module import),
so setting it here would either come too late or leak into other test modules.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from blend.rope import default_inv_freq, rerope_, rerope_dense, rerope_layers_

REPO = Path(__file__).resolve().parents[2]
MAX_POS = 32768
MATCHED_ATOL = 1e-5  # measured ~1e-6
UNMATCHED_ATOL = 5e-2  # measured ~5e-3


def _config(head_dim: int, theta: float, llama3: bool) -> LlamaConfig:
    kw = dict(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
              max_position_embeddings=131072, rope_theta=theta)
    if llama3:
        kw["rope_scaling"] = dict(rope_type="llama3", rope_theta=theta, factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192)
    return LlamaConfig(**kw)


def _inv_freq(cfg: LlamaConfig, llama3: bool) -> torch.Tensor:
    if llama3:
        inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
        return inv_freq
    return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)[0]


def _hf_rope(k: torch.Tensor, pos: torch.Tensor, rotary: LlamaRotaryEmbedding) -> torch.Tensor:
    """transformers' RoPE of pre-RoPE keys k[N, H, D] at positions pos[N]."""
    x = k.permute(1, 0, 2)[None]  # [1, H, N, D]
    cos, sin = rotary(x, pos[None])
    _, k_embed = apply_rotary_pos_emb(x, x, cos, sin)
    return k_embed[0].permute(1, 0, 2)


CASES = [(64, 10000.0, False), (128, 500000.0, False), (64, 100000.0, True), (128, 500000.0, True)]


@pytest.mark.parametrize("head_dim,theta,llama3", CASES)
def test_inv_freq_matches_transformers(head_dim, theta, llama3):
    cfg = _config(head_dim, theta, llama3)
    rotary = LlamaRotaryEmbedding(cfg)
    assert torch.equal(rotary.inv_freq, _inv_freq(cfg, llama3))
    if not llama3:
        assert torch.equal(default_inv_freq(head_dim, theta), rotary.inv_freq)
    else:  # scaling really changed the low frequencies, so the llama3 cases test something else
        assert not torch.allclose(default_inv_freq(head_dim, theta), rotary.inv_freq)


@pytest.mark.parametrize("head_dim,theta,llama3", CASES)
def test_paged_rerope_equals_rope_at_new_position(head_dim, theta, llama3):
    cfg = _config(head_dim, theta, llama3)
    rotary = LlamaRotaryEmbedding(cfg)
    inv_freq = _inv_freq(cfg, llama3)
    kvh, num_blocks, block_size, n = 2, 40, 16, 300
    k_pre = torch.randn(n, kvh, head_dim)
    p = torch.randint(0, MAX_POS, (n,))
    q = torch.randint(0, MAX_POS, (n,))
    q[:5] = p[:5]  # zero shift included
    pool = torch.randn(num_blocks, block_size, kvh, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:n]
    flat = pool.view(-1, kvh, head_dim)
    flat[slots] = _hf_rope(k_pre, p, rotary)
    expected = _hf_rope(k_pre, q, rotary)

    unmatched = pool.clone()
    rerope_(pool, slots, p, q, inv_freq, backend="torch")
    assert (flat[slots] - expected).abs().max().item() < MATCHED_ATOL
    assert torch.equal(flat[slots[:5]], _hf_rope(k_pre[:5], p[:5], rotary))  # zero shift is exact

    rerope_(unmatched, slots, p, q, inv_freq, backend="torch", match_fp32_angles=False)
    err = (unmatched.view(-1, kvh, head_dim)[slots] - expected).abs().max().item()
    assert err < UNMATCHED_ATOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_rerope_half_precision(dtype):
    cfg = _config(64, 10000.0, False)
    rotary = LlamaRotaryEmbedding(cfg)
    n, kvh, hd = 200, 3, 64
    k_pre = torch.randn(n, kvh, hd)
    p, q = torch.randint(0, MAX_POS, (n,)), torch.randint(0, MAX_POS, (n,))
    pool = torch.zeros(20, 16, kvh, hd, dtype=dtype)
    slots = torch.randperm(320)[:n]
    pool.view(-1, kvh, hd)[slots] = _hf_rope(k_pre, p, rotary).to(dtype)
    rerope_(pool, slots, p, q, rotary.inv_freq, backend="torch")
    got = pool.view(-1, kvh, hd)[slots].float()
    expected = _hf_rope(k_pre, q, rotary)
    # One rounding of the stored key plus one of the result: ~2 units of eps*|k|.
    bound = 2 * torch.finfo(dtype).eps * expected.abs().max().item()
    assert (got - expected).abs().max().item() < bound
    assert got.dtype == torch.float32 and pool.dtype == dtype


def test_unlisted_slots_untouched_and_round_trip():
    kvh, hd = 3, 64
    pool = torch.randn(10, 8, kvh, hd)
    original = pool.clone()
    slots = torch.tensor([3, 17, 18, 64, 79])
    p = torch.randint(0, MAX_POS, (5,))
    q = torch.randint(0, MAX_POS, (5,))
    inv_freq = default_inv_freq(hd)
    rerope_(pool, slots, p, q, inv_freq)  # auto on CPU -> torch
    others = torch.ones(80, dtype=torch.bool)
    others[slots] = False
    flat, orig_flat = pool.view(-1, kvh, hd), original.view(-1, kvh, hd)
    assert torch.equal(flat[others], orig_flat[others])
    assert not torch.allclose(flat[slots], orig_flat[slots])
    rerope_(pool, slots, q, p, inv_freq)
    assert torch.allclose(flat[slots], orig_flat[slots], atol=MATCHED_ATOL, rtol=0)


def test_all_layers_at_once_equals_layer_by_layer():
    kvh, hd, n = 3, 64, 90
    pools = [torch.randn(12, 16, kvh, hd) for _ in range(4)]
    expected = [p.clone() for p in pools]
    slots = torch.randperm(12 * 16)[:n]
    p, q = torch.randint(0, MAX_POS, (n,)), torch.randint(0, MAX_POS, (n,))
    inv_freq = default_inv_freq(hd)
    for pool in expected:
        rerope_(pool, slots, p, q, inv_freq)
    before = [x.clone() for x in pools]
    rerope_layers_(pools, slots, p, q, inv_freq)
    for got, want, orig in zip(pools, expected, before):
        assert torch.equal(got, want) and not torch.equal(got, orig)
    # Arguments are checked for every layer before any layer is modified.
    bad = pools + [torch.randn(12, 16, kvh, 128)]
    snapshot = [x.clone() for x in pools]
    with pytest.raises(ValueError):
        rerope_layers_(bad, slots, p, q, inv_freq)
    assert all(torch.equal(a, b) for a, b in zip(pools, snapshot))


def test_each_layer_is_moved_with_its_own_row_of_a_table():
    """Gemma 3: sliding layers rotate with base 10k, global ones with 1M; a [layers, d/2] table moves each
    layer's keys with its own row, i.e. to the key transformers' RoPE of that base gives at the new position."""
    kvh, hd, n = 2, 64, 50
    thetas = [10000.0, 10000.0, 1000000.0, 10000.0]
    rotaries = {t: LlamaRotaryEmbedding(_config(hd, t, False)) for t in set(thetas)}
    table = torch.stack([rotaries[t].inv_freq for t in thetas])
    k_pre = [torch.randn(n, kvh, hd) for _ in thetas]
    slots = torch.randperm(12 * 16)[:n]
    p, q = torch.randint(0, MAX_POS, (n,)), torch.randint(0, MAX_POS, (n,))
    pools = [torch.zeros(12, 16, kvh, hd) for _ in thetas]
    for pool, k, t in zip(pools, k_pre, thetas):
        pool.view(-1, kvh, hd)[slots] = _hf_rope(k, p, rotaries[t])
    rerope_layers_(pools, slots, p, q, table)
    for pool, k, t in zip(pools, k_pre, thetas):
        want = _hf_rope(k, q, rotaries[t])
        assert (pool.view(-1, kvh, hd)[slots] - want).abs().max().item() < MATCHED_ATOL, t


def test_a_table_of_one_repeated_row_gives_the_numbers_of_that_vector():
    """A uniform model passes a table whose rows are equal: the same bits as one vector for every layer."""
    kvh, hd, n, layers = 3, 64, 70, 5
    inv_freq = default_inv_freq(hd, 500000.0)
    pools = [torch.randn(12, 16, kvh, hd) for _ in range(layers)]
    by_table = [x.clone() for x in pools]
    slots = torch.randperm(12 * 16)[:n]
    p, q = torch.randint(0, MAX_POS, (n,)), torch.randint(0, MAX_POS, (n,))
    rerope_layers_(pools, slots, p, q, inv_freq)
    rerope_layers_(by_table, slots, p, q, inv_freq.expand(layers, -1).clone())
    assert all(torch.equal(a, b) for a, b in zip(pools, by_table))
    with pytest.raises(ValueError, match="layers"):
        rerope_layers_(pools, slots, p, q, inv_freq.expand(layers + 1, -1))


def test_dense_matches_paged_and_transformers():
    cfg = _config(128, 500000.0, True)
    rotary = LlamaRotaryEmbedding(cfg)
    n, kvh, hd = 100, 2, 128
    k_pre = torch.randn(n, kvh, hd)
    p, q = torch.randint(0, MAX_POS, (n,)), torch.randint(0, MAX_POS, (n,))
    k_p = _hf_rope(k_pre, p, rotary)
    expected = _hf_rope(k_pre, q, rotary)
    dense = rerope_dense(k_p, q - p, rotary.inv_freq, old_pos=p)
    assert (dense - expected).abs().max().item() < MATCHED_ATOL
    assert (rerope_dense(k_p, q - p, rotary.inv_freq) - expected).abs().max().item() < UNMATCHED_ATOL
    # A constant int shift; k_p itself is not modified.
    before = k_p.clone()
    shifted = rerope_dense(k_p, 1000, rotary.inv_freq, old_pos=p)
    assert torch.equal(k_p, before)
    assert (shifted - _hf_rope(k_pre, p + 1000, rotary)).abs().max().item() < MATCHED_ATOL


def test_argument_errors():
    pool = torch.randn(4, 4, 2, 64)
    inv_freq = default_inv_freq(64)
    ok = torch.tensor([0, 1])
    with pytest.raises(ValueError):
        rerope_(pool, ok, ok, ok, default_inv_freq(128))
    with pytest.raises(IndexError):
        rerope_(pool, torch.tensor([0, 16]), ok, ok, inv_freq)
    with pytest.raises(ValueError):
        rerope_(pool, ok, torch.tensor([0]), ok, inv_freq)
    with pytest.raises(TypeError):
        rerope_(pool, ok.float(), ok, ok, inv_freq)
    with pytest.raises(ValueError):
        rerope_(pool, ok, ok, ok, inv_freq, backend="cuda")
    with pytest.raises(ValueError):  # blocks not laid out as one slot dim
        rerope_(pool.transpose(0, 1), ok, ok, ok, inv_freq)


_TRITON_SCRIPT = textwrap.dedent(
    """
    import torch
    from blend.rope import rerope_torch_, default_inv_freq
    from blend.rope_triton import rerope_triton_

    seed = int.from_bytes(__import__("os").urandom(4), "little")
    print("seed", seed, file=__import__("sys").stderr)  # shown with a failure, to run its case again
    g = torch.Generator().manual_seed(seed)
    cases = 0
    shapes = [(1, 64), (3, 64), (2, 128), (4, 128), (5, 96)]
    for kvh, hd in shapes:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for match in (True, False):
                block_size = int(torch.randint(1, 33, (1,), generator=g))
                num_blocks = int(torch.randint(4, 40, (1,), generator=g))
                pool = torch.randn(num_blocks, block_size, kvh, hd, generator=g).to(dtype)
                # A sequence laid out on a random block table; a random subset of its slots.
                table = torch.randperm(num_blocks, generator=g)[: max(1, num_blocks // 2)]
                seq_len = int(torch.randint(1, table.numel() * block_size + 1, (1,), generator=g))
                i = torch.arange(seq_len)
                seq_slots = table[i // block_size] * block_size + i % block_size
                keep = torch.rand(seq_len, generator=g) < 0.7
                keep[0] = True
                slots = seq_slots[keep]
                n = slots.numel()
                old = torch.randint(0, 32768, (n,), generator=g)
                new = torch.randint(0, 32768, (n,), generator=g)
                inv_freq = default_inv_freq(hd, float(torch.randint(10**4, 10**6, (1,), generator=g)))
                a, b = pool.clone(), pool.clone()
                rerope_torch_(a, slots, old, new, inv_freq, match_fp32_angles=match)
                rerope_triton_(b, slots, old, new, inv_freq, match_fp32_angles=match)
                untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
                untouched[slots] = False
                flat_b, flat_p = b.view(-1, kvh, hd), pool.view(-1, kvh, hd)
                assert torch.equal(flat_b[untouched], flat_p[untouched]), (kvh, hd, dtype)
                assert not torch.equal(flat_b[slots], flat_p[slots]) or bool((old == new).all())
                # fp32: both compute cos/sin in fp32 of the same angle, ~1e-6 apart.
                # fp16/bf16: the same fp32 values may round to neighbouring representable numbers.
                tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * a.float().abs().max().item()
                err = (a.float() - b.float()).abs().max().item()
                assert err <= tol, (kvh, hd, dtype, match, err)
                cases += 1
    # every layer with its own row of a table (Gemma 3's two bases), as rerope_layers_ hands them out
    from blend.rope import rerope_layers_
    table = torch.stack([default_inv_freq(64, 10000.0), default_inv_freq(64, 1000000.0)] * 2)
    pools = [torch.randn(8, 16, 2, 64, generator=g) for _ in range(4)]
    slots = torch.randperm(128, generator=g)[:90]
    old, new = torch.randint(0, 32768, (90,), generator=g), torch.randint(0, 32768, (90,), generator=g)
    a, b = [x.clone() for x in pools], [x.clone() for x in pools]
    rerope_layers_(a, slots, old, new, table, backend="torch")
    rerope_layers_(b, slots, old, new, table, backend="triton")
    for x, y in zip(a, b):
        assert (x - y).abs().max().item() <= 1e-5
    print("OK", cases)
    """
)


def test_triton_kernel_matches_torch_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["OK", "30"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernel_matches_torch_on_cuda():
    from blend.rope_triton import rerope_triton_

    for kvh, hd in [(3, 64), (8, 128)]:
        pool = torch.randn(64, 16, kvh, hd, device="cuda")
        slots = torch.randperm(1024, device="cuda")[:700]
        old = torch.randint(0, MAX_POS, (700,), device="cuda")
        new = torch.randint(0, MAX_POS, (700,), device="cuda")
        inv_freq = default_inv_freq(hd).cuda()
        a, b = pool.clone(), pool.clone()
        rerope_(a, slots, old, new, inv_freq, backend="torch")
        rerope_triton_(b, slots, old, new, inv_freq)
        assert (a - b).abs().max().item() < 1e-5
