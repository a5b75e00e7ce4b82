"""The model fingerprint: everything that decides which KV a token block gets, digested into the identity
that seeds every block hash (radix.hashing).

Two servers whose fingerprints agree compute the same KV for the same tokens, so they may share blocks (a
disk tier after a restart, a Redis tier between servers); anything that changes the KV changes the
fingerprint: the architecture, the weights as loaded (their bytes, so a re-quantized or fine-tuned file
differs), the compute dtype (and int8 activations), the tokenizer and chat template, the block size, the KV
storage dtype and the hash algorithm. The served model name is not part of it: renaming a model keeps its
cache."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch
import xxhash

FINGERPRINT_VERSION = 1


@dataclass(frozen=True)
class ModelFingerprint:
    model: str  # the architecture and its shapes (ModelConfig), as canonical JSON
    weights: str  # xxh3-128 of every parameter's name, dtype, shape and bytes, as loaded
    tokenizer: str  # xxh3-128 of the tokenizer's definition and chat template
    dtype: str  # the compute dtype
    kv_dtype: str  # the KV pool's storage dtype
    block_size: int
    hash_algo: str
    version: int = FINGERPRINT_VERSION
    # the products' activations where not the compute dtype (--activation-dtype int8); None, and then left out
    # of the identity, keeps the fingerprints servers had before the option
    activations: str | None = None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["activations"] is None:
            del d["activations"]
        return d

    @property
    def identity(self) -> bytes:
        """32 bytes naming this fingerprint (sha256 of its canonical JSON)."""
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).digest()

    @property
    def short(self) -> str:
        return self.identity.hex()[:16]


def weights_digest(model: torch.nn.Module) -> str:
    """Digest of the parameters and buffers as loaded (before any packing for the CPU kernels), and of the
    weights held quantized (codes, scales and minimums, which are no state dict entries)."""
    tensors = dict(model.state_dict())
    for name, module in model.named_modules():
        weight = module.__dict__.get("qweight")
        if weight is not None:
            for part in ("codes", "scales", "mins"):
                if getattr(weight, part) is not None:
                    tensors[f"{name}.qweight.{weight.kind}.{weight.group}.{part}"] = getattr(weight, part)
    digest = xxhash.xxh3_128()
    for name, tensor in sorted(tensors.items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        data = tensor.detach().contiguous().cpu()
        if data.numel():
            digest.update(data.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    digest = xxhash.xxh3_128()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
    digest.update(repr(getattr(tokenizer, "chat_template", None)).encode())
    digest.update(repr(sorted(getattr(tokenizer, "special_tokens_map", {}).items())).encode())
    return digest.hexdigest()


def fingerprint(model: torch.nn.Module, model_config, tokenizer, dtype: torch.dtype, kv_dtype: torch.dtype,
                block_size: int, hash_algo: str, activations: str = "fp32") -> ModelFingerprint:
    return ModelFingerprint(
        model=json.dumps(dataclasses.asdict(model_config), sort_keys=True, default=str),
        weights=weights_digest(model), tokenizer=tokenizer_digest(tokenizer), dtype=str(dtype).removeprefix("torch."),
        kv_dtype=str(kv_dtype).removeprefix("torch."), block_size=block_size, hash_algo=hash_algo,
        activations=None if activations == "fp32" else activations)
