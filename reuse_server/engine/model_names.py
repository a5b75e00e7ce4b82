"""The names a server answers to. As vLLM's `--served-model-name a b c`: every served name is accepted in a
request's `model` and listed by /v1/models, and the first is the id every answer reports (so a client asking
under another name learns which model answered). Besides those, the name given to `--model` is accepted
(not listed): `--model gemma3-270m` serves the id `gemma-3-270m`, and a client configured with the flag's
spelling must not get a 404 for it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reuse_server.model.bundled import bundled_model


@dataclass(frozen=True)
class ModelNames:
    served: tuple[str, ...]  # --served-model-name, or the one derived from --model; never empty
    aliases: tuple[str, ...] = ()  # accepted too, not listed: the --model name

    def __post_init__(self) -> None:
        if not self.served:
            raise ValueError("a server needs at least one served model name")

    @property
    def id(self) -> str:
        """The name answers report (the `model` field) and gateways register the worker under."""
        return self.served[0]

    def accepts(self, name: str) -> bool:
        return name in self.served or name in self.aliases


def model_names(model: str | None, served_model_name: str | list[str] | tuple[str, ...] | None) -> ModelNames:
    """The names for a --model value and --served-model-name (one name or several, as vLLM's flag takes)."""
    if isinstance(served_model_name, str):
        served_model_name = [served_model_name]
    served = tuple(dict.fromkeys(served_model_name or [])) or (default_model_id(model),)
    alias = model.strip() if model and model.strip() else None
    return ModelNames(served, (alias,) if alias is not None and alias not in served else ())


def default_model_id(model: str | None) -> str:
    """The id of a model served without --served-model-name: a bundled model's own name, else the file or
    folder name (without .gguf)."""
    bundled = bundled_model(model)
    if bundled is not None:
        return bundled.display_name
    name = Path(model.rstrip("/")).name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name
