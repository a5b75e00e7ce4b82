"""The model side of the engine: config, weight loading, and a Llama-family forward over a paged KV pool.

The names below load their module on first use (PEP 562), so that the torch-free modules of this package
(config, errors, bundled, gguf_metadata) can be imported without importing torch: `reuse-server kv-calc`
reads a model's config through them (kv/kv_geometry.py) and answers in well under a second."""

from importlib import import_module

_EXPORTS = {
    "AttentionMetadata": "attention",
    "DecoderLayer": "llama",
    "LlamaModel": "llama",
    "ModelConfig": "config",
    "ModelLoadError": "errors",
    "RotaryEmbedding": "rope",
    "apply_rotary": "rope",
    "load_model": "loader",
    "load_tokenizer": "loader",
    "resolve_model": "loader",
    "rotate_half": "rope",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
