"""transformers' tokenizer of a Hugging Face folder: what a folder not converted from a GGUF is served with
(loader.load_tokenizer), and what xgrammar reads beside our own tokenizer (tokenizer.ServedTokenizer)."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import ModelLoadError


def load_transformers_tokenizer(path: Path):
    """transformers' tokenizer of an HF folder."""
    try:
        if _declares_its_own_class(Path(path)):
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


def _declares_its_own_class(path: Path) -> bool:
    """Whether AutoTokenizer would load the folder's tokenizer as the TokenizersBackend its
    tokenizer_config.json names (as every folder converted from a llama GGUF does), because transformers
    registers no tokenizer class of its own for the model type. Loading that class directly skips
    AutoTokenizer's read of the model config, which imports transformers' model-config modules and, through
    them, torch.distributed and sympy: resident for the server's life, used by nothing it runs."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    try:
        declared = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (isinstance(declared, dict) and declared.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in declared and model_type is not None
            and TOKENIZER_MAPPING_NAMES.get(model_type) is None)
