"""Test helper: fill a KV pool with random K/V, through the pool's own write."""
import torch


def fill_pool(pool, generator: torch.Generator | None = None) -> None:
    slots = torch.arange(pool.num_slots)
    shape = (pool.num_slots, pool.num_kv_heads, pool.head_dim)
    for layer in range(pool.num_layers):
        pool.write(layer, slots, torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
