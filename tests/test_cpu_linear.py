"""Linear layers on oneDNN-packed weights (what the engine serves on the CPU) compute what F.linear does."""

import pytest
import torch
import torch.nn.functional as F

from reuse_server.model import load_model
from reuse_server.model.cpu_linear import PackedLinear, onednn_linear_available

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 8, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows * 2 + bias)
    weight = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 64, generator=gen)[:, 5:45]  # a non-contiguous view, as a sliced activation is
    out = PackedLinear(weight, b)(x)
    ref = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)


def test_packed_linear_bf16():
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 32, generator=gen).bfloat16()
    x = torch.randn(5, 32, generator=gen).bfloat16()
    out = PackedLinear(weight)(x)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), F.linear(x.float(), weight.float()), rtol=2e-2, atol=2e-2)


def test_pack_for_cpu_replaces_every_linear_once(tiny_llama_path):
    model, config = load_model(tiny_llama_path)
    dense = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert dense == 7 * config.num_layers + (0 if config.tie_word_embeddings else 1)
    assert model.pack_for_cpu() == 7 * config.num_layers + 1  # + the output head
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.pack_for_cpu() == 0  # idempotent


def test_pack_for_cpu_skips_fp16(tiny_llama_path):
    model, _ = load_model(tiny_llama_path, dtype=torch.float16)
    assert model.pack_for_cpu() == 0
    assert any(isinstance(m, torch.nn.Linear) for m in model.modules())
