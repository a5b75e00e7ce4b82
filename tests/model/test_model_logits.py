"""Our paged Llama-family forward gives transformers' logits (same weights, eager attention, fp32) for
prefill, decode, chunked prefill, mixed batches and non-contiguous query positions, through the CPU
attention kernel (what the engine uses in fp32 on the CPU) and through torch's attention (its fallback).

Tolerance: max |ours - reference| / max |reference| <= 1e-4."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pools import fill_pool
from reuse_server.kv.pool import KVPool
from reuse_server.model.llama import OutputRows
from reuse_server.model import AttentionMetadata, attention, load_model, native
from tiny_checkpoint import write_tiny_checkpoint

REL_TOL = 1e-4
BLOCK_SIZE = 4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


class Sequence:
    """One sequence's token ids and its randomly chosen, non-contiguous pool blocks."""

    def __init__(self, token_ids: list[int], block_ids: list[int]):
        self.token_ids = token_ids
        self.block_table = torch.tensor(block_ids, dtype=torch.long)

    def slots(self, positions: list[int]) -> list[int]:
        return [int(self.block_table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def run_step(model, pool, work: list[tuple[Sequence, list[int], int]]) -> torch.Tensor:
    """One forward over several sequences; work items are (sequence, query positions, context length).
    Returns fp32 logits for every query token, in batch order."""
    ids, positions, slots, starts = [], [], [], [0]
    for seq, pos, _ in work:
        ids += [seq.token_ids[p] for p in pos]
        positions += pos
        slots += seq.slots(pos)
        starts.append(len(ids))
    meta = AttentionMetadata(
        query_start=starts,
        block_tables=[seq.block_table for seq, _, _ in work],
        context_lens=[ctx for _, _, ctx in work],
        slot_mapping=torch.tensor(slots, dtype=torch.long),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(positions), meta, pool)
        return model.compute_logits(hidden)


def make_sequences(lengths: list[int], pool: KVPool, vocab: int, seed: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(pool.num_blocks, generator=gen).tolist()
    seqs = []
    for n in lengths:
        blocks = [free.pop() for _ in range(-(-n // BLOCK_SIZE))]
        seqs.append(Sequence(torch.randint(3, vocab, (n,), generator=gen).tolist(), blocks))
    return seqs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_llama_path, tiny_qwen2_path):
    root = tmp_path_factory.mktemp("model-logits")
    return {
        "llama": tiny_llama_path,
        "qwen2": tiny_qwen2_path,
        "llama-tied-mha": write_tiny_checkpoint(
            root / "tied", arch="llama", seed=2, num_kv_heads=4, tie_word_embeddings=True
        ),
        "llama3-rope": write_tiny_checkpoint(
            root / "llama3",
            arch="llama",
            seed=3,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        "mistral-sliding": write_tiny_checkpoint(
            root / "mistral", arch="mistral", seed=4, num_kv_heads=1, sliding_window=6
        ),
        "qwen3": write_tiny_checkpoint(root / "qwen3", arch="qwen3", seed=5),
        # Gemma 3's shape: sliding layers around a global one (each with its RoPE base), one KV head, tied
        # embeddings; prompts here run past the window of 6
        "gemma3": write_tiny_checkpoint(
            root / "gemma3", arch="gemma3", seed=6, num_layers=3, num_kv_heads=1, sliding_window=6,
            rope_theta=1_000_000.0, tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        # the same text model in Gemma 3 4B's layout: under text_config and language_model., beside a vision tower
        "gemma3-multimodal": write_tiny_checkpoint(
            root / "gemma3-mm", arch="gemma3-multimodal", seed=7, num_layers=3, num_kv_heads=1, sliding_window=6,
            rope_theta=1_000_000.0, tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    }


_loaded: dict = {}


def models(checkpoints, name, matmul="native", attention="torch"):
    """Our model with its linear layers packed for the native kernel (as the engine serves it) or for oneDNN,
    or on plain F.linear (matmul="torch"), attending through the CPU kernel (attention="kernel") or torch; and
    transformers' reference."""
    if (name, matmul, attention) not in _loaded:
        ours, config = load_model(checkpoints[name])
        ours.pack_for_cpu(matmul)
        assert ours.use_cpu_attention_kernel(attention == "kernel") == (attention == "kernel"), native.failure()
        ref = AutoModelForCausalLM.from_pretrained(checkpoints[name], attn_implementation="eager", dtype=torch.float32)
        _loaded[name, matmul, attention] = (ours, config, ref.eval())
    return _loaded[name, matmul, attention]


def reference_logits(ref, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref(input_ids=torch.tensor([token_ids])).logits[0].float()


def new_pool(config, num_blocks=64) -> KVPool:
    return KVPool(config.num_layers, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float32, "cpu")


ALL = ["llama", "qwen2", "llama-tied-mha", "llama3-rope", "mistral-sliding", "qwen3", "gemma3"]
ATTENTION = ["kernel", "torch"]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("matmul", ["native", "onednn", "torch"])
@pytest.mark.parametrize("name", ALL)
def test_prefill_matches_transformers(checkpoints, name, matmul, attention):
    ours, config, ref = models(checkpoints, name, matmul, attention)
    pool = new_pool(config)
    (seq,) = make_sequences([37], pool, config.vocab_size, seed=10)
    logits = run_step(ours, pool, [(seq, list(range(37)), 37)])
    assert rel_err(logits, reference_logits(ref, seq.token_ids)) <= REL_TOL


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", ALL)
def test_decode_matches_transformers(checkpoints, name, attention):
    ours, config, ref = models(checkpoints, name, attention=attention)
    pool = new_pool(config)
    (seq,) = make_sequences([24], pool, config.vocab_size, seed=11)
    prompt_len = 19
    run_step(ours, pool, [(seq, list(range(prompt_len)), prompt_len)])
    for p in range(prompt_len, 24):  # one token per step, attending over everything before it
        step_logits = run_step(ours, pool, [(seq, [p], p + 1)])
        expected = reference_logits(ref, seq.token_ids[: p + 1])[-1:]
        assert rel_err(step_logits, expected) <= REL_TOL, f"decode step at position {p}"


@pytest.mark.parametrize("path", ["kernel", "torch-gqa-folded", "torch-gqa-heads"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral-sliding", "gemma3"])
def test_chunked_prefill_matches_transformers(checkpoints, name, path, monkeypatch):
    """Chunks of a few rows: the kernel; torch's path folds the query heads of a KV head into rows
    (attention.FOLD_MAX_ROWS), or with folding off takes SDPA's GQA path. All give transformers' logits."""
    monkeypatch.setattr(attention, "FOLD_MAX_ROWS", 0 if path == "torch-gqa-heads" else attention.FOLD_MAX_ROWS)
    ours, config, ref = models(checkpoints, name, attention="kernel" if path == "kernel" else "torch")
    pool = new_pool(config)
    (seq,) = make_sequences([23], pool, config.vocab_size, seed=12)
    chunks, start, pieces = [5, 11, 7], 0, []  # boundaries 5 and 16 fall inside blocks of 4
    for size in chunks:
        positions = list(range(start, start + size))
        pieces.append(run_step(ours, pool, [(seq, positions, start + size)]))
        start += size
    assert rel_err(torch.cat(pieces), reference_logits(ref, seq.token_ids)) <= REL_TOL


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", ["llama", "qwen2", "llama3-rope", "gemma3"])
def test_mixed_batch_matches_transformers(checkpoints, name, attention):
    """A full prefill, a decode step, a middle prefill chunk and a one-token prompt in one forward."""
    ours, config, ref = models(checkpoints, name, attention=attention)
    pool = new_pool(config)
    full, decoding, chunked, single = make_sequences([13, 10, 15, 1], pool, config.vocab_size, seed=13)
    run_step(ours, pool, [(decoding, list(range(9)), 9), (chunked, list(range(6)), 6)])
    logits = run_step(
        ours,
        pool,
        [
            (full, list(range(13)), 13),
            (decoding, [9], 10),
            (chunked, list(range(6, 12)), 12),
            (single, [0], 1),
        ],
    )
    expected = torch.cat(
        [
            reference_logits(ref, full.token_ids),
            reference_logits(ref, decoding.token_ids)[9:10],
            reference_logits(ref, chunked.token_ids[:12])[6:12],
            reference_logits(ref, single.token_ids),
        ]
    )
    assert logits.shape == expected.shape
    assert rel_err(logits, expected) <= REL_TOL


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", ["llama", "mistral-sliding", "gemma3"])
def test_non_contiguous_positions_layer_by_layer(checkpoints, name, attention):
    """Recomputing a scattered subset of positions, layer by layer (as blending does), over a KV pool
    that already holds the whole sequence gives the full-prefill logits at those positions."""
    ours, config, ref = models(checkpoints, name, attention=attention)
    pool = new_pool(config)
    (seq,) = make_sequences([21], pool, config.vocab_size, seed=14)
    run_step(ours, pool, [(seq, list(range(21)), 21)])
    subset = [2, 3, 9, 14, 20]
    meta = AttentionMetadata([0, len(subset)], [seq.block_table], [21], torch.tensor(seq.slots(subset)))
    positions = torch.tensor(subset)
    with torch.inference_mode():
        hidden = ours(torch.tensor([seq.token_ids[p] for p in subset]), positions, meta, pool)
        logits = ours.compute_logits(hidden)
    assert rel_err(logits, reference_logits(ref, seq.token_ids)[subset]) <= REL_TOL


@pytest.mark.parametrize("attention", ATTENTION)
def test_multimodal_gemma3_folder_runs_its_language_model(checkpoints, attention):
    """A Gemma 3 4B-style folder: the text model's config completed by transformers from text_config, its
    tensors found under language_model., the vision tower's skipped; text logits are transformers'."""
    ours, config, ref = models(checkpoints, "gemma3-multimodal", attention=attention)
    assert type(ref).__name__ == "Gemma3ForConditionalGeneration"
    assert config.architecture == "gemma3_text" and config.layer_windows == (6, None, 6)
    pool = new_pool(config)
    (seq,) = make_sequences([29], pool, config.vocab_size, seed=22)
    run_step(ours, pool, [(seq, list(range(20)), 20)])
    logits = run_step(ours, pool, [(seq, list(range(20, 29)), 29)])
    assert rel_err(logits, reference_logits(ref, seq.token_ids)[20:]) <= REL_TOL


@pytest.mark.parametrize("attention", ATTENTION)
def test_fresh_kv_is_written_before_attending(checkpoints, attention):
    """A query attends to its own fresh K/V: stale pool contents at its slot must not leak in."""
    ours, config, ref = models(checkpoints, "llama", attention=attention)
    pool = new_pool(config)
    fill_pool(pool)
    (seq,) = make_sequences([9], pool, config.vocab_size, seed=15)
    logits = run_step(ours, pool, [(seq, list(range(9)), 9)])
    assert rel_err(logits, reference_logits(ref, seq.token_ids)) <= REL_TOL


@pytest.mark.parametrize("attention", ATTENTION)
def test_query_position_outside_context_is_rejected(checkpoints, attention):
    ours, config, _ = models(checkpoints, "llama", attention=attention)
    pool = new_pool(config)
    (seq,) = make_sequences([8], pool, config.vocab_size, seed=16)
    with pytest.raises(ValueError, match="query positions"):
        run_step(ours, pool, [(seq, list(range(8)), 7)])


def test_bf16_forward_stays_close_to_fp32(checkpoints):
    """The dtype path (bf16 weights, activations and KV pool) runs the same code; bf16 keeps ~3 digits."""
    ours32, config, _ = models(checkpoints, "qwen2")
    ours16, _ = load_model(checkpoints["qwen2"], dtype=torch.bfloat16)
    ours16.pack_for_cpu()
    pool32 = new_pool(config)
    pool16 = KVPool(config.num_layers, 64, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.bfloat16, "cpu")
    (seq,) = make_sequences([30], pool32, config.vocab_size, seed=17)
    full = list(range(30))
    logits32 = run_step(ours32, pool32, [(seq, full, 30)])
    logits16 = run_step(ours16, pool16, [(seq, full, 30)])
    assert logits16.dtype == torch.float32
    assert rel_err(logits16, logits32) <= 3e-2  # measured 1.1e-2


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_batched_decode_matches_transformers(checkpoints, name, attention):
    """Several sequences decoding one token each in one batch (torch: the padded single-call path)."""
    ours, config, ref = models(checkpoints, name, attention=attention)
    pool = new_pool(config)
    lengths = [9, 23, 16, 31]
    seqs = make_sequences(lengths, pool, config.vocab_size, seed=14)
    for seq, n in zip(seqs, lengths):
        run_step(ours, pool, [(seq, list(range(n - 2)), n - 2)])
    for back in (2, 1):  # two decode steps, all four sequences in one batch
        logits = run_step(ours, pool, [(seq, [n - back], n - back + 1) for seq, n in zip(seqs, lengths)])
        for row, (seq, n) in enumerate(zip(seqs, lengths)):
            expected = reference_logits(ref, seq.token_ids[: n - back + 1])[-1:]
            assert rel_err(logits[row:row + 1], expected) <= REL_TOL


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("consecutive", [False, True])
def test_long_chunk_and_scattered_queries_attend_in_groups(checkpoints, name, consecutive, attention):
    """A chunk deep in the context and a scattered subset of queries: torch's path attends them in position
    groups, each against only the keys its last query sees, over consecutive blocks reading the pool in
    place; the kernel takes them as several units of rows. Both must still give transformers' logits."""
    ours, config, ref = models(checkpoints, name, attention=attention)
    pool = new_pool(config)
    n = 160
    if consecutive:
        gen = torch.Generator().manual_seed(16)
        seq = Sequence(torch.randint(3, config.vocab_size, (n,), generator=gen).tolist(), list(range(7, 7 + n // 4)))
    else:
        (seq,) = make_sequences([n], pool, config.vocab_size, seed=15)
    expected = reference_logits(ref, seq.token_ids)
    first = run_step(ours, pool, [(seq, list(range(30)), 30)])
    rest = run_step(ours, pool, [(seq, list(range(30, n)), n)])
    assert rel_err(torch.cat([first, rest]), expected) <= REL_TOL

    subset = sorted(torch.randperm(n, generator=torch.Generator().manual_seed(17))[:90].tolist())
    meta = AttentionMetadata([0, len(subset)], [seq.block_table], [n], torch.tensor(seq.slots(subset)))
    positions = torch.tensor(subset)
    groups = meta.sequence_masks(positions, None, torch.float32)[0].groups
    assert len(groups) > 1 and groups[0][2] < n  # the first group reads fewer keys than the context
    assert (meta.consecutive_start(pool, 0) is not None) == consecutive
    with torch.inference_mode():
        hidden = ours(torch.tensor([seq.token_ids[p] for p in subset]), positions, meta, pool)
        logits = ours.compute_logits(hidden)
    assert rel_err(logits, expected[subset]) <= REL_TOL


@pytest.mark.parametrize("split", [True, False], ids=["prefix-in-place", "gathered"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_warm_queries_over_a_consecutive_prefix_match_transformers(checkpoints, name, split, monkeypatch):
    """A warm request's shape: a long prefix in consecutive blocks, the last blocks elsewhere, a few new
    queries after the prefix. With SPLIT_CACHED_PREFIX the prefix is attended in place and the rest gathered,
    merged by log-sum-exp; without, everything is gathered. Both give transformers' logits."""
    monkeypatch.setattr(attention, "SPLIT_CACHED_PREFIX", split)
    ours, config, ref = models(checkpoints, name)
    pool = new_pool(config)
    n, run = 75, 15  # 15 consecutive blocks (60 tokens), then 4 blocks elsewhere
    gen = torch.Generator().manual_seed(19)
    blocks = list(range(3, 3 + run)) + [40, 31, 45, 22]
    seq = Sequence(torch.randint(3, config.vocab_size, (n,), generator=gen).tolist(), blocks)
    expected = reference_logits(ref, seq.token_ids)
    run_step(ours, pool, [(seq, list(range(62)), 62)])
    used = []
    real = attention._attend_split
    monkeypatch.setattr(attention, "_attend_split", lambda *a: used.append(1) or real(*a))
    warm = run_step(ours, pool, [(seq, list(range(62, n)), n)])  # 13 queries at positions 62..74
    assert rel_err(warm, expected[62:]) <= REL_TOL
    assert bool(used) == split


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral-sliding", "gemma3"])
def test_output_rows_skip_the_last_layer_for_the_others_but_keep_their_kv(checkpoints, name, attention):
    """With OutputRows the last layer attends and runs its MLP only for those tokens (what the runner asks
    for: the rows whose logits it samples). Their logits are the full forward's, and every token's K/V is
    still written: a chunk computed with no output rows at all serves the next chunk exactly."""
    ours, config, ref = models(checkpoints, name, attention=attention)
    pool = new_pool(config)
    (seq,) = make_sequences([30], pool, config.vocab_size, seed=21)
    expected = reference_logits(ref, seq.token_ids)

    def step(positions, ctx, rows):
        meta = AttentionMetadata([0, len(positions)], [seq.block_table], [ctx], torch.tensor(seq.slots(positions)))
        with torch.inference_mode():
            hidden = ours(torch.tensor([seq.token_ids[p] for p in positions]), torch.tensor(positions), meta, pool,
                          OutputRows(torch.tensor(rows, dtype=torch.long), config.num_layers))
            return ours.compute_logits(hidden)

    assert step(list(range(12)), 12, []).shape[0] == 0  # a chunk mid-prompt: K/V only
    picked = step(list(range(12, 25)), 25, [0, 5, 12])
    assert rel_err(picked, expected[[12, 17, 24]]) <= REL_TOL
    rest = run_step(ours, pool, [(seq, list(range(25, 30)), 30)])  # attends over all 25 earlier tokens' K/V
    assert rel_err(rest, expected[25:30]) <= REL_TOL
