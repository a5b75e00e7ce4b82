"""Find a model (bundled GGUF, a .gguf file, or a Hugging Face folder) and load weights and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from .bundled import bundled_gguf_path, bundled_names, is_bundled
from .config import ModelConfig
from .errors import ModelLoadError
from .gguf_convert import ensure_converted
from .llama import LlamaModel
from .quant_linear import QuantizedEmbedding, QuantizedLinear
from .gguf_quant import quantize
from .quant_weights import WEIGHT_DTYPES, QuantizedWeight, from_tensors, kind_for, read_layouts

_IGNORED_CHECKPOINT_KEYS = ("rotary_emb.inv_freq",)
# Gemma 3's multimodal checkpoints (4B and up): the language model's tensors under a prefix (the hub's layout,
# which transformers 5 still writes, or transformers 5's own), beside a vision tower this engine does not run
_LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.", "language_model.")
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# config.json files that leave most fields to transformers' defaults (Gemma 3 4B's text_config names five)
_CONFIGS_WITH_DEFAULTS = {"gemma3", "gemma3_text"}


def model_source(name_or_path: str | None) -> Path:
    """The file or folder a model name stands for: the bundled GGUF, a .gguf file, or an HF folder."""
    if is_bundled(name_or_path):
        return bundled_gguf_path(name_or_path)
    return Path(name_or_path).expanduser()


def resolve_model(name_or_path: str | None, weight_dtype: str = "fp32") -> Path:
    """A Hugging Face folder (config.json + safetensors + tokenizer) for the given model:
    None/"bundled"/"smollm2"/"SmolLM2-135M-Instruct", "gemma3-270m" -> a bundled GGUF, converted once and cached;
    a .gguf file -> converted once and cached; a folder with config.json -> itself. A GGUF is converted into
    a folder of its own per weight dtype (quant_weights.WEIGHT_DTYPES); an HF folder is quantized at load."""
    if is_bundled(name_or_path):
        return ensure_converted(bundled_gguf_path(name_or_path), weight_dtype=weight_dtype)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {name_or_path!r}: no such file or folder {path} (expected a bundled model ({bundled_names()}), "
            f"a .gguf file, or a Hugging Face folder with config.json)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"model file {path} is not a .gguf file")
        return ensure_converted(path, weight_dtype=weight_dtype)
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds GGUF files {ggufs}: pass one of them" if ggufs else ""
        raise ModelLoadError(f"model folder {path} has no config.json{hint}")
    return path


def read_config(path: Path) -> ModelConfig:
    config_file = Path(path) / "config.json"
    try:
        hf = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"model folder {path} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from e
    generation_config = Path(path) / "generation_config.json"
    if generation_config.is_file():  # Llama 3 instruct lists its end-of-turn token only here
        extra = json.loads(generation_config.read_text()).get("eos_token_id")
        if extra is not None:
            ids = hf.get("eos_token_id")
            ids = list(ids) if isinstance(ids, (list, tuple)) else ([] if ids is None else [ids])
            extra = extra if isinstance(extra, (list, tuple)) else [extra]
            hf = {**hf, "eos_token_id": ids + [i for i in extra if i not in ids]}
    if hf.get("model_type") in _CONFIGS_WITH_DEFAULTS:
        hf = _with_defaults(path, hf)
    try:
        return ModelConfig.from_hf(hf)
    except KeyError as e:
        raise ModelLoadError(f"{config_file} lacks the field {e.args[0]!r}") from e
    except ModelLoadError as e:
        raise ModelLoadError(f"{config_file}: {e}") from e


def _with_defaults(path: Path, hf: dict) -> dict:
    """The config as transformers' own config class completes it; for a multimodal Gemma 3, its text_config,
    with the end-of-turn tokens the top level (or generation_config.json) lists."""
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(str(path)).get_text_config().to_dict()
    except Exception as e:
        raise ModelLoadError(f"{path}/config.json: transformers cannot read it: {e}") from e
    eos = [hf.get("eos_token_id"), text.get("eos_token_id")]
    ids = [i for e in eos for i in (e if isinstance(e, (list, tuple)) else [e]) if i is not None]
    return {**text, "model_type": "gemma3_text", "eos_token_id": list(dict.fromkeys(ids))}


def _parameter_name(key: str, multimodal: bool) -> str | None:
    """Our parameter name for a checkpoint key (None: a tensor of the vision tower, skipped)."""
    if multimodal:
        if key.startswith(_VISION_PREFIXES):
            return None
        for prefix in _LANGUAGE_MODEL_PREFIXES:
            if key.startswith(prefix):
                return key[len(prefix):]
    return key.removeprefix("model.")


def _is_multimodal(path: Path) -> bool:
    return json.loads((Path(path) / "config.json").read_text()).get("model_type") == "gemma3"


def safetensors_files(path: Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {path} has no *.safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"model folder {path}: the safetensors index names missing files {missing}")
    return files


def load_model(
    path: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", weight_dtype: str = "fp32"
) -> tuple[LlamaModel, ModelConfig]:
    """Build the model from an HF folder (see resolve_model), in inference mode (no grads). With a weight
    dtype other than fp32 the matrices are held in it (quant_weights; the output head in at least 8 bits):
    read as stored where the folder holds them quantized (a GGUF's conversion), else quantized here. They
    load as QuantizedLinear/QuantizedEmbedding, which LlamaModel.pack_for_cpu hands to their kernels."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {weight_dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}")
    path = Path(path)
    config = read_config(path)
    multimodal = _is_multimodal(path)
    with torch.device("meta"), _SkipInit():
        model = LlamaModel(config)
    expected = set(model.state_dict().keys())
    matrices = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    unexpected = []
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                layouts = read_layouts(f.metadata())
                parts = {key: f.get_tensor(key) for key in f.keys() if key.rsplit(".", 1)[0] in layouts}
                for key, layout in layouts.items():
                    name = _parameter_name(key, multimodal)
                    if name is None:
                        continue
                    if name in expected:
                        quantized[name] = from_tensors(key, layout, parts)
                    elif not (name == "lm_head.weight" and model.lm_head is None):
                        unexpected.append(key)
                for key in f.keys():
                    name = _parameter_name(key, multimodal)
                    if key in parts or name is None:
                        continue
                    if name in expected and weight_dtype != "fp32" and name in matrices:
                        quantized[name] = quantize(f.get_tensor(key), kind_for(name, weight_dtype))
                    elif name in expected:
                        state[name] = _as_loaded(name, f.get_tensor(key), config).to(device=device, dtype=dtype)
                    elif not (key.endswith(_IGNORED_CHECKPOINT_KEYS) or (name == "lm_head.weight" and model.lm_head is None)):
                        unexpected.append(key)
        except (ModelLoadError, ValueError):
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read weights from {file}: {e}") from e
    for name, weight in quantized.items():
        _hold_quantized(model, name, weight.to(device), dtype)
    missing = sorted(set(model.state_dict().keys()) - state.keys())
    if missing:
        raise ModelLoadError(f"model folder {path}: the checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    if unexpected:
        raise ModelLoadError(
            f"model folder {path}: the checkpoint has tensors this Llama-family model does not use, "
            f"e.g. {unexpected[:5]} (a different architecture?)"
        )
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"model folder {path}: weights do not fit config.json: {e}") from e
    model.reset_rotary(device)
    model.eval().requires_grad_(False)
    return model, config


class _SkipInit(TorchFunctionMode):
    """Skips torch.nn.init's initializers (the in-place ones, named with a trailing underscore) while a model
    is built on the meta device, where there is no data to initialize: meta tensors run torch's Python
    reference ops, whose first use imports torch._dynamo (with sympy and triton), which would then stay
    resident for the server's life though it never compiles anything."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_"):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _as_loaded(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Gemma's checkpoints store each RMSNorm weight w and the norm multiplies by (1 + w), computed in fp32 (as
    transformers' Gemma3RMSNorm does): the offset is added here once, so the forward's RMSNorm is Llama's."""
    if config.norm_weight_offset and name.endswith("norm.weight"):
        return config.norm_weight_offset + tensor.float()
    return tensor


def _hold_quantized(model: LlamaModel, name: str, weight: QuantizedWeight, dtype: torch.dtype) -> None:
    """Replace the nn.Linear / nn.Embedding whose weight is `name` by its quantized placeholder."""
    parent_name, _, attr = name.removesuffix(".weight").rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    if tuple(old.weight.shape) != weight.shape:
        raise ModelLoadError(f"{name}: the checkpoint's {weight.shape} does not fit config.json's "
                             f"{tuple(old.weight.shape)}")
    if isinstance(old, nn.Embedding):
        setattr(parent, attr, QuantizedEmbedding(weight, dtype))
    else:  # a meta bias stands in until load_state_dict assigns the checkpoint's
        setattr(parent, attr, QuantizedLinear(weight, None if old.bias is None else old.bias))


def load_tokenizer(path: Path):
    """The tokenizer of an HF folder (with its chat template, if it has one): for a folder converted from a
    GGUF, its tokenizer.json through the `tokenizers` library (model/tokenizer.py: transformers stays out of
    the server), else transformers' tokenizer."""
    from .tokenizer import ServedTokenizer, readable
    from .transformers_tokenizer import load_transformers_tokenizer

    if readable(Path(path)):
        try:
            return ServedTokenizer.from_folder(Path(path))
        except Exception as e:
            raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e
    return load_transformers_tokenizer(path)
