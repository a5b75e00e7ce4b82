"""The start-up sizing of the KV cache for one engine: reads the device's figures (host RAM; on CUDA the
card's free memory and what our weights hold on it) once the weights are loaded, and hands them to the rules
of kv/sizing.py. Explicit sizes (--kv-cache-memory SIZE, --num-gpu-blocks, --cpu-cache-size SIZE) win."""
from __future__ import annotations

import torch

from reuse_server.engine.config import EngineConfig
from reuse_server.kv.sizing import (CardMemory, KVSizing, activation_bytes, read_machine_memory, size_for_cpu,
                                    size_for_gpu)
from reuse_server.model.config import ModelConfig


def size_kv_cache(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype) -> KVSizing:
    """What the pool and the host tier get (pool_bytes is not used when config.num_gpu_blocks is given)."""
    machine = read_machine_memory()
    device = torch.device(config.device)
    pool, flag = config.kv_cache_memory, "--kv-cache-memory"
    if config.num_gpu_blocks:  # the pool's size is a block count; its bytes are known once it is made
        pool, flag = 0, f"--num-gpu-blocks {config.num_gpu_blocks}"
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        element = torch.finfo(dtype).bits // 8
        card = CardMemory(total=total, free=free, weight_bytes=torch.cuda.memory_allocated(device),
                          activation_bytes=activation_bytes(
                              mc.hidden_size, mc.intermediate_size, mc.num_heads * mc.head_dim,
                              mc.num_kv_heads * mc.head_dim, mc.vocab_size, config.max_num_batched_tokens,
                              config.max_num_seqs, element))
        sizing = size_for_gpu(card, machine, pool, config.cpu_cache_size, config.gpu_memory_utilization,
                              config.kv_cache_share, device=str(device), pool_flag=flag)
    else:
        sizing = size_for_cpu(machine, pool, config.cpu_cache_size, config.kv_cache_share, device=str(device),
                              pool_flag=flag)
    return sizing
