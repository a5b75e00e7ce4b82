"""Where a host-RAM hit's time goes, in process (no HTTP): a 4,096-token prompt computed, hit on the device,
pushed out to host RAM by two other prompts (a pool of 1.3 prompts, as bench_tiers sizes it), then hit from host
RAM under cProfile. Prints the first-token times and the profile's top entries.

    python -m benchmarks.profile_host_hit
"""
import cProfile, pstats, time, random, io
from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import SamplingParams
bs=16; L=4096
e = build_engine(EngineConfig(num_gpu_blocks=int(1.3*L/bs), cpu_cache_size=8*10**9, max_num_batched_tokens=2048))
rng = random.Random(0)
def prompt(seed):
    r = random.Random(seed); return [r.randrange(100, 40000) for _ in range(L)]
def run(rid, ids):
    e.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0))
    t=time.perf_counter(); first=None
    while e.has_work():
        outs=e.step()
        if first is None and any(o.new_token_ids for o in outs): first=time.perf_counter()-t
    return first
p0 = prompt(0)
print("cold", run("a", p0))
print("device", run("b", p0[:-8]+[5,6,7,8,9,10,11,12]))
for i in range(2): run(f"f{i}", prompt(10+i))
pr=cProfile.Profile(); pr.enable()
t=run("c", p0[:-8]+[15,16,17,18,19,20,21,22])
pr.disable()
print("host hit", t, e.snapshot()["tiers"])
s=io.StringIO(); pstats.Stats(pr,stream=s).sort_stats("cumulative").print_stats(30); print(s.getvalue()[:6000])
