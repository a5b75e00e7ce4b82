"""Block identities leave the process (tiers, other servers): the same prompt must get the same block hashes
in every process built from the same model, and different ones for another model, block size or KV dtype."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from reuse_server.engine.config import EngineConfig
from reuse_server.engine.builder import build_engine
from reuse_server.engine.sampling_params import CacheOptions
from tiny_checkpoint import write_tiny_checkpoint

PROMPT = list(range(3, 3 + 37))

SCRIPT = """
import json, sys
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.builder import build_engine
config = EngineConfig(**json.loads(sys.argv[1]))
engine = build_engine(config)
print(json.dumps([h.hex() for h in engine.block_hashes(json.loads(sys.argv[2]))]))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {seed: write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny{seed}"), arch="llama", seed=seed)
            for seed in (0, 1)}


def hashes_in_a_new_process(hash_seed: int, **config) -> list[str]:
    """Build an engine in a fresh interpreter (its own PYTHONHASHSEED) and return the prompt's block hashes."""
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(config), json.dumps(PROMPT)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_same_model_names_the_same_blocks_in_every_process(checkpoints):
    config = dict(model=str(checkpoints[0]), block_size=4, num_gpu_blocks=32, blend_key_shift=False)
    first = hashes_in_a_new_process(1, **config)
    second = hashes_in_a_new_process(2, **config)
    assert len(first) == len(PROMPT) // 4 and first == second
    here = build_engine(EngineConfig(**config))
    assert [h.hex() for h in here.block_hashes(PROMPT)] == first
    # a namespace (a tenant's salt) names other blocks
    assert here.block_hashes(PROMPT, CacheOptions(cache_salt="tenant-b"))[0].hex() != first[0]


@pytest.mark.parametrize("change", ["model", "block_size", "dtype"])
def test_another_model_block_size_or_kv_dtype_names_other_blocks(checkpoints, change):
    base = dict(model=str(checkpoints[0]), block_size=4, num_gpu_blocks=32, blend_key_shift=False)
    other = dict(base, **{"model": dict(model=str(checkpoints[1])), "block_size": dict(block_size=8),
                          "dtype": dict(dtype="bfloat16")}[change])
    ours = build_engine(EngineConfig(**base)).block_hashes(PROMPT)
    theirs = build_engine(EngineConfig(**other)).block_hashes(PROMPT)
    assert not set(ours) & set(theirs)
