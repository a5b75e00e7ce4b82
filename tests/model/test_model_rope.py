import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from reuse_server.model.config import ModelConfig
from reuse_server.model.rope import RotaryEmbedding, apply_rotary

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def configs(rope_parameters):
    hf = LlamaConfig(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        num_hidden_layers=1, vocab_size=10, rope_parameters=rope_parameters,
    )
    return hf, ModelConfig.from_hf(hf.to_dict())


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {**LLAMA3, "rope_theta": 500000.0},
    ],
)
def test_rotation_equals_transformers(rope_parameters):
    hf_config, config = configs(rope_parameters)
    ours = RotaryEmbedding(config)
    theirs = LlamaRotaryEmbedding(hf_config)
    assert torch.equal(ours.inv_freq, theirs.inv_freq)
    positions = torch.tensor([0, 1, 7, 100, 4095])
    x = torch.randn(5, 2, 64)
    cos, sin = theirs(x, positions[None])
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    assert torch.equal(apply_rotary(x, *ours.cos_sin(positions, torch.float32)), expected[0].transpose(0, 1))


def test_llama3_scaling_changes_low_frequencies_only():
    _, plain = configs({"rope_type": "default", "rope_theta": 500000.0})
    _, scaled = configs({**LLAMA3, "rope_theta": 500000.0})
    a, b = RotaryEmbedding(plain).inv_freq, RotaryEmbedding(scaled).inv_freq
    assert torch.equal(a[:3], b[:3])  # wavelengths below 64/4 = 16 positions untouched
    assert not torch.equal(a[3], b[3])
    assert torch.allclose(b[-1], a[-1] / 8)  # the lowest ones divided by the factor


def test_moving_rotated_keys_is_a_rotation_by_the_delta():
    """What blending's re-RoPE relies on: K rotated for position a, rotated again by (b - a), is K at b."""
    _, config = configs({"rope_type": "default", "rope_theta": 10000.0})
    rope = RotaryEmbedding(config)
    k = torch.randn(4, 1, 64, dtype=torch.float64)
    old, new = torch.tensor([3, 50, 200, 1000]), torch.tensor([10, 7, 900, 1000])
    at_old = apply_rotary(k, *rope.cos_sin(old, torch.float64))
    moved = apply_rotary(at_old, *rope.cos_sin(new - old, torch.float64))
    assert torch.allclose(moved, apply_rotary(k, *rope.cos_sin(new, torch.float64)), atol=1e-4)


def test_the_table_rows_are_each_position_s_own_cos_sin():
    """The fused decode reads RoPE's cos and sin out of RotaryEmbedding.table: each row must be what cos_sin
    gives that position alone, bit for bit, or fused and per-op steps would rotate differently."""
    _, config = configs({**LLAMA3, "rope_theta": 500000.0})
    rotary = RotaryEmbedding(config)
    cos, sin = rotary.table(8192)
    for p in range(8192):
        one_cos, one_sin = rotary.cos_sin(torch.tensor([p]), torch.float32)
        assert torch.equal(cos[p], one_cos[0]) and torch.equal(sin[p], one_sin[0]), f"position {p}"
