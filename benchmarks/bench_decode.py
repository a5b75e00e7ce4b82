"""Where one decode step's time goes, on the bundled SmolLM2 with int4 weights (issue #28).

In this process, through the engine (`LLMEngine.step`, as the server's engine thread runs it), one stream
decoding `--tokens` tokens after a short prompt:
- step_ms: a whole step (schedule, forward, sample, update), uninstrumented, best of --repeats runs;
- forward_ms: the runner's forward alone (inputs built, layers, head), uninstrumented;
- then one more pass with timers around the parts (each timed inclusive of its own Python call): linear
  (the quantized products and the head), attention (the CPU kernel and its plan), kv_write (the pool's store),
  norm_rope (RMSNorm, RoPE, the SiLU gating), embed; python_dispatch is the uninstrumented forward minus
  those; scheduler (schedule + update, less the detokenizer), sampler, detokenizer.
Over HTTP, a server (`reuse-server serve`, same weights and threads) streams `--tokens` tokens to one client:
http_ms is the time between its first and last streamed token per token (best of --repeats), and http_overhead_ms = http_ms -
step_ms is what the async engine, the API and SSE (and the client) add per token.
Then 8 concurrent streams over HTTP (mean per-stream ms/token), and the memory read bandwidth of this
machine in the same run (a torch sum over 256 MiB: the floor a step's weight bytes set).

    .venv/bin/python -m benchmarks.bench_decode [--tokens 128] [--threads 2] [--no-http]

Prints JSON lines. The CPU is shared: compare figures within one run.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections import defaultdict

MIB = 1 << 20


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def read_bandwidth_gb_s(mib: int = 256) -> float:
    import torch
    a = torch.ones(mib * MIB // 4)
    a.sum()
    best = min(_timed(a.sum) for _ in range(5))
    return a.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Timers:
    """Inclusive wall time per part, by wrapping callables (class attributes or instance methods)."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self._undo = []

    def wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def engine_breakdown(args) -> dict:
    import torch
    from reuse_server.engine.builder import build_engine
    from reuse_server.engine.config import EngineConfig
    from reuse_server.engine.detokenizer import IncrementalDetokenizer
    from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
    from reuse_server.kv.pool import KVPool
    from reuse_server.model import cpu_attention, cpu_ops, llama, quant_linear, rope

    engine = build_engine(EngineConfig(weight_dtype=args.weight_dtype, kv_cache_memory=384 * MIB))
    params = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    prompt = engine.tokenizer.encode("Write a long story about a lighthouse keeper who finds a map in a bottle.")

    def decode_steps(tag: str, n: int) -> float:
        engine.add_request(tag, prompt, params, CacheOptions(prefix_cache=False))
        for _ in range(4):  # prefill and a few warm steps
            engine.step()
        start = time.perf_counter()
        for _ in range(n):
            engine.step()
        elapsed = time.perf_counter() - start
        engine.abort(tag)
        return elapsed / n

    runner = engine.runner
    forward_seconds = [0.0]
    original_run = runner.run

    def timed_run(*a, **kw):
        start = time.perf_counter()
        try:
            return original_run(*a, **kw)
        finally:
            forward_seconds[0] += time.perf_counter() - start

    runner.run = timed_run
    steps, forwards = [], []
    for i in range(args.repeats):
        forward_seconds[0] = 0.0
        steps.append(decode_steps(f"plain{i}", args.tokens))
        forwards.append(forward_seconds[0] / (args.tokens + 4))  # the 4 warm-up steps ran through it too
    best = min(range(args.repeats), key=steps.__getitem__)  # the run the shared CPU disturbed least
    step_s, forward_s = steps[best], forwards[best]
    runner.run = original_run

    timers = Timers()
    timers.wrap(quant_linear.NativeQuantLinear, "forward", "linear")
    timers.wrap(cpu_attention.CpuAttentionKernel, "__call__", "attention")
    timers.wrap(cpu_attention, "KernelPlan", "attention")
    timers.wrap(KVPool, "write", "kv_write")
    timers.wrap(llama.RMSNorm, "forward", "norm_rope")
    timers.wrap(llama, "apply_rotary", "norm_rope")
    timers.wrap(cpu_ops.NativeOps, "silu_mul", "norm_rope")
    timers.wrap(llama.LlamaModel, "embed", "embed")
    timers.wrap(runner, "run", "forward")
    timers.wrap(engine.sampler, "sample", "sampler")
    timers.wrap(engine.scheduler, "schedule", "scheduler")
    timers.wrap(engine.scheduler, "update", "scheduler")
    timers.wrap(IncrementalDetokenizer, "add", "detokenizer")
    timers.wrap(engine, "step", "step")
    decode_steps("timed", args.tokens)
    timers.restore()
    per = {k: 1e3 * v / args.tokens for k, v in timers.seconds.items()}
    kernels = sum(per.get(k, 0.0) for k in ("linear", "attention", "kv_write", "norm_rope", "embed"))
    row = dict(
        step_ms=round(1e3 * step_s, 2), forward_ms=round(1e3 * forward_s, 2),
        linear_ms=round(per["linear"], 2), attention_ms=round(per["attention"], 2),
        kv_write_ms=round(per["kv_write"], 2), norm_rope_ms=round(per["norm_rope"], 2),
        embed_ms=round(per["embed"], 2),
        python_dispatch_ms=round(1e3 * forward_s - kernels, 2),
        scheduler_ms=round(per["scheduler"] - per["detokenizer"], 3), sampler_ms=round(per["sampler"], 3),
        detokenizer_ms=round(per["detokenizer"], 3),
        instrumented_step_ms=round(per["step"], 2),
        linear_calls_per_step=None,
        threads=torch.get_num_threads())
    row["linear_calls_per_step"] = sum(isinstance(m, quant_linear.NativeQuantLinear) for m in
                                       runner.model.modules()) + (runner.model.packed_head is not None)
    return row


def http_figures(args) -> dict:
    import openai
    from benchmarks.bench_ttft import server_process, served_model
    from benchmarks.bench_weights import decode

    with server_process("--model", "smollm2", "--weight-dtype", args.weight_dtype, "--kv-cache-memory", "384MiB") \
            as (url, _proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1200)
        model = served_model(url)
        decode(client, model, 1, 4)  # lazy initialisation out of the way
        one = min(decode(client, model, 1, args.tokens) for _ in range(args.repeats))  # best of, as step_ms
        eight = decode(client, model, 8, args.tokens)
    return dict(http_ms_b1=round(one, 2), http_ms_b8=round(eight, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weight-dtype", default="int4")
    ap.add_argument("--no-http", action="store_true")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported, and for the server
    from reuse_server.server.openmp import apply_short_spin
    apply_short_spin()
    import torch
    torch.set_num_threads(args.threads)
    row = dict(bench="decode_breakdown", weight_dtype=args.weight_dtype, tokens=args.tokens,
               read_gb_s=round(read_bandwidth_gb_s(), 1))
    row.update(engine_breakdown(args))
    if not args.no_http:
        row.update(http_figures(args))
        row["http_overhead_ms"] = round(row["http_ms_b1"] - row["step_ms"], 2)
    emit(**row)


if __name__ == "__main__":
    main()
