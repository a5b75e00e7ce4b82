"""One-time conversion of a GGUF file into a Hugging Face folder cached on disk.

The folder holds config.json, model.safetensors (fp32: the dequantized values d*q+m of Q4/Q8 blocks are not
exactly representable in fp16/bf16, and fp32 keeps our logits comparable with transformers'), and the
tokenizer files with the chat template from the GGUF metadata. Later starts load the safetensors directly.

transformers parses the GGUF metadata into a config and a tokenizer; the weights are dequantized here with
the `gguf` package (transformers' own GGUF weight loading needs `accelerate` and, in 5.x, keeps weights
packed). llama.cpp permutes the Q/K rows of "llama"-architecture models for its RoPE layout; that is
undone here exactly as transformers does it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import xxhash
from safetensors.torch import save_file
from tqdm import tqdm

from .errors import ModelLoadError

log = logging.getLogger(__name__)

CONVERTER_VERSION = "2"  # bump when the folder layout changes, so old caches are not reused
_PERMUTED_ARCHITECTURES = {"llama"}  # GGUF archs whose Q/K rows llama.cpp's converter permuted
_SUPPORTED_GGUF_ARCHITECTURES = {"llama", "qwen2"}
# GGUF pre-tokenizer names that llama.cpp runs as "split every digit off, then the GPT-2 regex" (the original
# tokenizers' Digits(individual_digits=True) + ByteLevel). transformers' GGUF converter drops that first
# step, and text then re-tokenizes differently from what the model generated (e.g. "\n\n" before a digit).
_DIGIT_SPLIT_PRETOKENIZERS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def default_cache_dir() -> Path:
    env = os.environ.get("KV_REUSE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kv-reuse-server"


def converted_folder_name(gguf_path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    digest.update(CONVERTER_VERSION.encode())
    return f"{gguf_path.stem}-{digest.hexdigest()[:12]}"


def ensure_converted(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The cached HF folder for gguf_path, converting it first if needed (atomically: a killed conversion
    leaves only a temporary folder, never a half-written cache entry)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / converted_folder_name(gguf_path)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=cache_dir))
    try:
        log.warning("converting %s into %s (one time)", gguf_path, target)
        convert_gguf(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent converter winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors and tokenizer files for gguf_path into out_dir."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    try:
        reader = gguf.GGUFReader(gguf_path)
        arch = reader.fields["general.architecture"].contents()
    except Exception as e:  # the gguf reader raises assorted errors on damaged files
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file: {type(e).__name__}: {e}") from e
    if arch not in _SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{gguf_path}: GGUF architecture {arch!r} is not supported")

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: transformers could not read its config/tokenizer: {e}") from e

    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"Dequantizing {name} (one time)", unit="tensor"):
        if tensor.name == "rope_freqs.weight":
            # Llama 3.1-style GGUFs keep their rope scaling only as this tensor, which the config does not
            # carry over; running without it would silently give wrong positions beyond the original context.
            raise ModelLoadError(
                f"{gguf_path}: GGUFs with rope_freqs (llama3 rope scaling) are not supported; "
                f"use the Hugging Face folder of this model instead"
            )
        hf_name = _hf_name(tensor.name)
        if hf_name is None:
            log.warning("%s: ignoring GGUF tensor %s", gguf_path, tensor.name)
            continue
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if arch in _PERMUTED_ARCHITECTURES and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if "q_proj" in hf_name else num_kv_heads
            weights = _reverse_llama_cpp_permutation(weights, heads)
        tensors[hf_name] = torch.from_numpy(np.array(weights, dtype=np.float32, order="C"))  # owns its memory

    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if "tokenizer.ggml.pre" in reader.fields and reader.fields["tokenizer.ggml.pre"].contents() in _DIGIT_SPLIT_PRETOKENIZERS:
        _split_digits_first(tokenizer)
    config.save_pretrained(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt", "source": name})
    if not tokenizer.chat_template:
        log.warning("%s has no tokenizer.chat_template; chat requests will need one", gguf_path)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "conversion.json").write_text(
        json.dumps({"source": str(gguf_path), "converter_version": CONVERTER_VERSION, "dtype": "float32"})
    )


def _split_digits_first(tokenizer) -> None:
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def _hf_name(gguf_name: str) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    return None


def _reverse_llama_cpp_permutation(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp: w.reshape(heads, 2, rows_per_head // 2, ...).swapaxes(1, 2); this is its inverse.
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
