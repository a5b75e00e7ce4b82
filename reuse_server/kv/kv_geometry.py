"""What a model's KV cache holds per layer, read from its config alone (no weights, no torch).

Sources: a Hugging Face config.json (the file, or a folder holding it), a GGUF file's metadata, or the bundled
model's GGUF. The architecture need not be one the engine runs: the calculator also sizes Gemma-2/3 (local and
global layers), Qwen with max_window_layers, Mistral (a window on every layer) and DeepSeek-V2/V3 (MLA)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reuse_server.kv.layout import KVGeometry, LayerKV

from reuse_server.model.bundled import bundled_gguf_path, bundled_model, bundled_names
from reuse_server.model.config import layer_windows
from reuse_server.model.errors import ModelLoadError
from reuse_server.model.gguf_metadata import read_gguf_metadata

# GGUF architecture names whose Hugging Face model_type differs (the layer patterns are keyed by model_type)
_GGUF_MODEL_TYPES = {"deepseek2": "deepseek_v2", "gemma3": "gemma3_text"}


@dataclass(frozen=True)
class ModelKV:
    name: str
    source: str  # the file the geometry was read from
    architecture: str  # Hugging Face model_type
    num_heads: int  # attention (query) heads, the most of any layer
    geometry: KVGeometry
    max_context: int | None  # the model's own context limit (max_position_embeddings), if it states one


def read_model_kv(model: str | None) -> ModelKV:
    """None or the bundled name, a .gguf file, a config.json file, or a folder holding config.json."""
    bundled = bundled_model(model)
    if bundled is not None:
        return model_kv_from_gguf(bundled_gguf_path(model), name=bundled.display_name)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {model!r}: no such file or folder {path} (expected a bundled model "
                             f"({bundled_names()}), a .gguf file, "
                             f"a config.json file, or a Hugging Face folder with config.json)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f"; it holds GGUF files {ggufs}: pass one of them" if ggufs else ""
            raise ModelLoadError(f"model folder {path} has no config.json{hint}")
        return model_kv_from_config_json(path / "config.json", name=path.name)
    if path.suffix.lower() == ".gguf":
        return model_kv_from_gguf(path)
    if path.suffix.lower() == ".json":
        return model_kv_from_config_json(path)
    raise ModelLoadError(f"model file {path} is neither a .gguf file nor a config.json")


def model_kv_from_config_json(path: Path, name: str | None = None) -> ModelKV:
    try:
        hf = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{path} is not a config.json (a JSON object)")
    return model_kv_from_hf(hf, name=name or hf.get("_name_or_path") or Path(path).parent.name, source=str(path))


def model_kv_from_gguf(path: Path, name: str | None = None) -> ModelKV:
    metadata = read_gguf_metadata(path)
    hf = hf_config_from_gguf(metadata, path)
    return model_kv_from_hf(hf, name=name or metadata.get("general.name") or Path(path).stem, source=str(path))


def model_kv_from_hf(hf: dict[str, Any], name: str, source: str) -> ModelKV:
    text = _text_config(hf)
    try:
        geometry = kv_geometry_from_hf(text)
        heads = text["num_attention_heads"]
    except KeyError as e:
        raise ModelLoadError(f"{source} lacks the field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: {e}") from e
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from e
    return ModelKV(name=str(name), source=source, architecture=text.get("model_type", ""),
                   num_heads=max(heads) if isinstance(heads, list) else int(heads), geometry=geometry,
                   max_context=text.get("max_position_embeddings"))


def kv_geometry_from_hf(hf: dict[str, Any]) -> KVGeometry:
    """Per layer: its KV heads (grouped-query: num_key_value_heads, one value or one per layer), head width
    and window; MLA (kv_lora_rank set): one latent of kv_lora_rank + qk_rope_head_dim elements per token."""
    num_layers = int(hf["num_hidden_layers"])
    windows = layer_windows(hf)
    if hf.get("kv_lora_rank"):
        latent = int(hf["kv_lora_rank"]) + int(hf["qk_rope_head_dim"])
        return KVGeometry(tuple(LayerKV(1, latent, 0, w) for w in windows), mla=True)
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    per_layer_heads = _per_layer(heads, num_layers, "num_attention_heads")
    per_layer_kv = _per_layer(kv_heads, num_layers, "num_key_value_heads")
    head_dim = hf.get("head_dim")
    layers = []
    for i in range(num_layers):
        width = int(head_dim or hf["hidden_size"] // per_layer_heads[i])
        layers.append(LayerKV(int(per_layer_kv[i]), width, width, windows[i]))
    return KVGeometry(tuple(layers))


def hf_config_from_gguf(metadata: dict[str, Any], path: Path) -> dict[str, Any]:
    """The config.json fields kv_geometry_from_hf reads, from GGUF metadata (keys as llama.cpp writes them)."""
    arch = metadata.get("general.architecture")
    if not arch:
        raise ModelLoadError(f"{path}: the GGUF metadata has no general.architecture")

    def get(key: str):
        return metadata.get(f"{arch}.{key}")

    if get("block_count") is None or get("attention.head_count") is None:
        raise ModelLoadError(f"{path}: the GGUF metadata lacks {arch}.block_count or {arch}.attention.head_count")
    hf: dict[str, Any] = {
        "model_type": _GGUF_MODEL_TYPES.get(arch, arch),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "hidden_size": get("embedding_length"),
        "head_dim": get("attention.key_length"),
        "max_position_embeddings": get("context_length"),
        "sliding_window": get("attention.sliding_window"),
    }
    pattern = get("attention.sliding_window_pattern")  # per layer (true: sliding), or every n-th layer global
    if isinstance(pattern, list):
        hf["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        hf["sliding_window_pattern"] = pattern
    if get("attention.kv_lora_rank"):
        hf.update(kv_lora_rank=get("attention.kv_lora_rank"), qk_rope_head_dim=get("rope.dimension_count"))
    return hf


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config (Gemma-3, Llama-4, ...) keeps the language model's fields under text_config."""
    text = hf.get("text_config")
    return {"model_type": hf.get("model_type", ""), **text} if isinstance(text, dict) else hf


def _per_layer(value, num_layers: int, field: str) -> list:
    if isinstance(value, list):
        if len(value) != num_layers:
            raise ValueError(f"{field} lists {len(value)} values for {num_layers} layers")
        return value
    return [value] * num_layers
