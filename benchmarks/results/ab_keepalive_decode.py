"""Decode over HTTP from a checkout before a change (argv[2]) and from this one, both servers up at once, turns
alternating: python benchmarks/results/ab_keepalive_decode.py TURNS BEFORE_CHECKOUT"""
import json, os, statistics, subprocess, sys, time
import httpx, psutil
sys.path.insert(0, os.getcwd())  # run from the repository root
from benchmarks import bench_weights
from reuse_server.server.openmp import with_short_spin
servers = {}
for name, cwd, port in (("before", sys.argv[2], 18601), ("after", os.getcwd(), 18602)):
    p = subprocess.Popen([f"{cwd}/.venv/bin/python", "-m", "reuse_server.server.cli", "serve", "--port", str(port),
                          "--kv-cache-memory", "384MiB", "--log-level", "warning"], cwd=cwd, env=with_short_spin(os.environ),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers[name] = (f"http://127.0.0.1:{port}", p)
try:
    for url, _ in servers.values():
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200: break
            except httpx.HTTPError: pass
            time.sleep(1)
    model = {n: httpx.get(u + "/v1/models").json()["data"][0]["id"] for n, (u, _) in servers.items()}
    for n, (u, _) in servers.items(): bench_weights.decode_lean(u, model[n], 1, 4, [])
    res = {n: {1: [], 8: [], "loop1": [], "loop8": []} for n in servers}
    def loop_s(pid): return next(t.user_time + t.system_time for t in psutil.Process(pid).threads() if t.id == pid)
    for turn in range(int(sys.argv[1])):
        for n in (("before", "after") if turn % 2 == 0 else ("after", "before")):
            u, p = servers[n]
            for streams in (1, 8):
                l0 = loop_s(p.pid)
                ms = bench_weights.decode_lean(u, model[n], streams, 128, [])
                res[n][streams].append(ms); res[n][f"loop{streams}"].append(1e3 * (loop_s(p.pid) - l0) / 128)
    for n, r in res.items():
        print(json.dumps({"code": n, **{f"ms_b{s}": [round(x, 2) for x in r[s]] for s in (1, 8)},
                          **{f"median_ms_b{s}": round(statistics.median(r[s]), 2) for s in (1, 8)},
                          **{f"loop_cpu_ms_step_b{s}": round(statistics.median(r[f'loop{s}']), 3) for s in (1, 8)}}))
finally:
    for _, p in servers.values(): p.terminate(); p.wait()
