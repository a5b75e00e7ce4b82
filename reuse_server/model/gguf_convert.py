"""One-time conversion of a GGUF file into a Hugging Face folder cached on disk.

The folder holds config.json, model.safetensors (fp32: the dequantized values d*q+m of Q4/Q8 blocks are not
exactly representable in fp16/bf16, and fp32 keeps our logits comparable with transformers'), and the
tokenizer files with the chat template from the GGUF metadata. Later starts load the safetensors directly.

transformers parses the GGUF metadata into a config and a tokenizer; the weights are dequantized here with
the `gguf` package (transformers' own GGUF weight loading needs `accelerate` and, in 5.x, keeps weights
packed). llama.cpp permutes the Q/K rows of "llama"-architecture models for its RoPE layout; that is
undone here exactly as transformers does it. llama.cpp stores Gemma's RMSNorm weights as 1 + w; the folder
holds w, as a Hugging Face Gemma checkpoint does (transformers' GGUF loader subtracts the 1 the same way), and
the loader adds the 1 back for every Gemma checkpoint alike. A GGUF without a chat template gets its family's
(chat_templates.py) and that template's end-of-turn token as an end of generation."""

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

from .cache_dir import default_cache_dir
from .chat_templates import FALLBACKS
from .errors import ModelLoadError
from .gguf_quant import load_tensor
from .quant_weights import WEIGHT_DTYPES, kind_for, metadata_entry, to_tensors

log = logging.getLogger(__name__)

CONVERTER_VERSION = "4"  # bump when the folder layout or what it holds (a fallback chat template) changes,
#                          so old caches are not reused
_PERMUTED_ARCHITECTURES = {"llama"}  # GGUF archs whose Q/K rows llama.cpp's converter permuted
_SUPPORTED_GGUF_ARCHITECTURES = {"llama", "qwen2", "gemma3"}
_NORMS_STORED_AS_ONE_PLUS_W = {"gemma3"}  # llama.cpp's converter adds 1 to Gemma's norm weights
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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma normalizes the attention's output and the MLP's input and output apart (transformers' names)
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_NAMES_BY_ARCHITECTURE = {"gemma3": _GEMMA_BLOCK_NAMES}


def _file_digest(path: Path, extra: bytes = b"") -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    digest.update(extra)
    return digest.hexdigest()


def gguf_fingerprint(gguf_path: Path) -> str:
    """xxh3 of the file's bytes: the key of its measured quality per weight dtype (weight_dtype.py)."""
    return _file_digest(gguf_path)


def converted_folder_name(gguf_path: Path, weight_dtype: str = "fp32") -> str:
    """The file's digest with the converter's version; fp32 folders keep the names they had before weight
    dtypes existed, each other weight dtype gets a folder of its own."""
    suffix = "" if weight_dtype == "fp32" else f"-{weight_dtype}"
    return f"{gguf_path.stem}-{_file_digest(gguf_path, CONVERTER_VERSION.encode())[:12]}{suffix}"


def ensure_converted(gguf_path: Path, cache_dir: Path | None = None, weight_dtype: str = "fp32") -> Path:
    """The cached HF folder for gguf_path with its weights in `weight_dtype` (fp32, or quant_weights' bf16,
    int8, int4), converting it first if needed (atomically: a killed conversion leaves only a temporary
    folder, never a half-written cache entry)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist")
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {weight_dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    base = converted_folder_name(gguf_path)
    folders = {d: cache_dir / (base if d == "fp32" else f"{base}-{d}") for d in WEIGHT_DTYPES}
    complete = [d for d, f in folders.items() if (f / "config.json").is_file() and (f / "model.safetensors").is_file()]
    target = folders[weight_dtype]
    if weight_dtype in complete:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=cache_dir))
    try:
        log.warning("converting %s into %s (one time)", gguf_path, target)
        convert_gguf(gguf_path, tmp, weight_dtype, folders[complete[0]] if complete else None)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent converter winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, weight_dtype: str = "fp32", converted: Path | None = None) -> None:
    """Write config.json, model.safetensors and tokenizer files for gguf_path into out_dir. With a weight
    dtype other than fp32, the matrices are stored in that layout (quant_weights: codes, scales, minimums),
    read out of the GGUF's blocks where they hold it exactly (gguf_quant.py); the rest stays fp32. `converted`:
    a finished conversion of the same file in another weight dtype, whose config and tokenizer files are
    copied instead of being parsed again (transformers takes most of a conversion's time)."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
        arch = reader.fields["general.architecture"].contents()
    except Exception as e:  # the gguf reader raises assorted errors on damaged files
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file: {type(e).__name__}: {e}") from e
    if arch not in _SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{gguf_path}: GGUF architecture {arch!r} is not supported")

    name = gguf_path.name
    if converted is not None:
        for file in converted.iterdir():
            if file.is_file() and file.name not in ("model.safetensors", "conversion.json"):
                shutil.copy2(file, out_dir / file.name)
        hf = json.loads((out_dir / "config.json").read_text())
        num_heads, num_kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
        tied = bool(hf.get("tie_word_embeddings", False))
    else:
        config, tokenizer = _config_and_tokenizer(gguf_path, reader, arch)
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        tied = config.tie_word_embeddings
    tensors: dict[str, torch.Tensor] = {}
    layouts: dict[str, dict] = {}
    verb = "Dequantizing" if weight_dtype == "fp32" else f"Loading {weight_dtype} weights of"
    for tensor in tqdm(reader.tensors, desc=f"{verb} {name} (one time)", unit="tensor"):
        if tensor.name == "rope_freqs.weight":
            # Llama 3.1-style GGUFs keep their rope scaling only as this tensor, which the config does not
            # carry over; running without it would silently give wrong positions beyond the original context.
            raise ModelLoadError(
                f"{gguf_path}: GGUFs with rope_freqs (llama3 rope scaling) are not supported; "
                f"use the Hugging Face folder of this model instead"
            )
        hf_name = _hf_name(tensor.name, _BLOCK_NAMES_BY_ARCHITECTURE.get(arch, _BLOCK_NAMES))
        if hf_name is None:
            log.warning("%s: ignoring GGUF tensor %s", gguf_path, tensor.name)
            continue
        permuted = arch in _PERMUTED_ARCHITECTURES and hf_name.endswith(("q_proj.weight", "k_proj.weight"))
        heads = num_heads if "q_proj" in hf_name else num_kv_heads
        if weight_dtype != "fp32" and len(tensor.shape) == 2:
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dimensions innermost first
            q = load_tensor(tensor.data, tensor.tensor_type, shape, kind_for(hf_name, weight_dtype))
            if permuted:  # a permutation of whole rows: codes, scales and minimums move together
                q = q.rows(torch.from_numpy(_reverse_llama_cpp_permutation(np.arange(shape[0]), heads)))
            parts, layouts[hf_name] = to_tensors(hf_name, q)
            tensors.update(parts)
            continue
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if arch in _NORMS_STORED_AS_ONE_PLUS_W and hf_name.endswith("norm.weight"):
            weights = weights - np.float32(1.0)
        if permuted:
            weights = _reverse_llama_cpp_permutation(weights, heads)
        tensors[hf_name] = torch.from_numpy(np.array(weights, dtype=np.float32, order="C"))  # owns its memory

    if tied:
        for key in [k for k in tensors if k.startswith("lm_head.weight")]:
            del tensors[key]
        layouts.pop("lm_head.weight", None)
    if converted is None:
        _name_the_architecture(config)
        config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"),
              metadata={"format": "pt", "source": name, **(metadata_entry(layouts) if layouts else {})})
    (out_dir / "conversion.json").write_text(
        json.dumps({"source": str(gguf_path), "converter_version": CONVERTER_VERSION, "dtype": "float32",
                    "weight_dtype": weight_dtype})
    )


def _config_and_tokenizer(gguf_path: Path, reader, arch: str):
    from transformers import AutoConfig, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: transformers could not read its config/tokenizer: {e}") from e
    if "tokenizer.ggml.pre" in reader.fields and reader.fields["tokenizer.ggml.pre"].contents() in _DIGIT_SPLIT_PRETOKENIZERS:
        _split_digits_first(tokenizer)
    if not tokenizer.chat_template and arch in FALLBACKS:
        template, end_of_turn = FALLBACKS[arch]
        log.warning("%s has no tokenizer.chat_template; chat requests use %s's turn format", gguf_path, arch)
        tokenizer.chat_template = template
        _add_eos(config, tokenizer.convert_tokens_to_ids(end_of_turn))
    elif not tokenizer.chat_template:
        log.warning("%s has no tokenizer.chat_template; chat requests will need one", gguf_path)
    return config, tokenizer


def _name_the_architecture(config) -> None:
    """A config read from GGUF metadata names its model type but no model class; tools that read the folder
    without transformers' GGUF path (NVIDIA Dynamo's frontend) refuse a config.json without `architectures`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not getattr(config, "architectures", None):
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]


def _add_eos(config, token_id: int) -> None:
    eos = config.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    if token_id not in ids:
        config.eos_token_id = ids + [token_id]


def _split_digits_first(tokenizer) -> None:
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def _hf_name(gguf_name: str, block_names: dict[str, str] = _BLOCK_NAMES) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{suffix}"
    return None


def _reverse_llama_cpp_permutation(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp: w.reshape(heads, 2, rows_per_head // 2, ...).swapaxes(1, 2); this is its inverse.
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
