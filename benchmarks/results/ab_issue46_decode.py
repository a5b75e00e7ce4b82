"""Decode tok/s at batch 1 and 8 (context 256, 64 tokens), from the checkout in cwd, several rounds."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from benchmarks.bench_engine import ours_decode, ours_prefill
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
torch.manual_seed(0)
engine = build_engine(EngineConfig(max_num_batched_tokens=8192, max_num_seqs=16, kv_cache_memory=1 << 30))
ours_prefill(engine, 64, 1)
label = sys.argv[1]
for r in range(int(sys.argv[2])):
    for batch in (1, 8):
        print(json.dumps({"code": label, "round": r, "batch": batch,
                          "tok_s": round(ours_decode(engine, batch, 256, 64), 1)}), flush=True)
