"""The model side of the engine: config, weight loading, and a Llama-family forward over a paged KV pool."""

from .attention import AttentionMetadata
from .config import ModelConfig
from .errors import ModelLoadError
from .llama import DecoderLayer, LlamaModel
from .loader import load_model, load_tokenizer, resolve_model
from .rope import RotaryEmbedding, apply_rotary, rotate_half

__all__ = [
    "AttentionMetadata",
    "DecoderLayer",
    "LlamaModel",
    "ModelConfig",
    "ModelLoadError",
    "RotaryEmbedding",
    "apply_rotary",
    "load_model",
    "load_tokenizer",
    "resolve_model",
    "rotate_half",
]
