"""Where one decode step's time goes, on the bundled SmolLM2 with int4 weights (issue #28), or another bundled
model (--model gemma3-270m --weight-dtype auto).

In this process, through the engine (`LLMEngine.step`, as the server's engine thread runs it), one stream
decoding `--tokens` tokens after a short prompt (or `--context` tokens of one):
- step_ms: a whole step (schedule, forward, sample, update), uninstrumented, best of --repeats runs;
- forward_ms: the runner's forward alone (inputs built, layers, head), uninstrumented;
- then one more pass with timers around the parts (each timed inclusive of its own Python call): linear
  (the quantized products and the head), attention (the CPU kernel and its plan), kv_write (the pool's store),
  norm_rope (RMSNorm, RoPE, the SiLU or GELU gating), fused_layers (the fused decode: every layer of a decode step in
  one native call, its plan included), embed; python_dispatch is the uninstrumented forward minus those;
  scheduler (schedule + update, less the detokenizer), sampler, detokenizer.
The fused row also has 8 streams decoding together in the engine (after a short prompt, not with --context):
step_ms_b8, and from one timed run fused_layers_ms_b8 and head_ms_b8.
A row with the fused decode (fused: true; fused_steps counts the steps it ran), then one with the per-op path
(fused: false), both from one engine whose timed repeats alternate; --no-fused: only the per-op row. Those rows
for each --activation-dtype setting in turn (by default fp32, the exact products, then int8).
Over HTTP, per row a server (`reuse-server serve`, same weights and threads, KV_REUSE_FUSED_DECODE as the row
says) streams `--tokens` tokens to one client: http_ms is the time between its first and last streamed token
per token (best of --repeats), and http_overhead_ms = http_ms - step_ms is what the async engine, the API and
SSE (and the client) add per token.
Then 8 concurrent streams over HTTP (mean per-stream ms/token). For 1 and 8 streams, server_loop_cpu_ms_b* and
client_cpu_ms_b* are the CPU a step cost the server's event loop (its main thread) and the client (--client lean:
one event loop reading raw SSE with httpx; openai: the SDK, a thread a stream), on the cores the engine decodes
on. Then the memory read bandwidth of this
machine in the same run (a torch sum over 256 MiB: the floor a step's weight bytes set), and its FMA ceiling
(fma_g_s: billions of fma_lanes-wide fp32 FMAs a second over --threads pinned threads, benchmarks/fma_peak.cpp:
the floor a step's arithmetic sets). Where `llama-server`
is on PATH, it serves the same GGUF on the same threads to the same client, at 1 and 8 streams.
With --products, only the model's quantized products of one decode step, replayed on 1 and --threads threads
through this tree's kernels and any other builds given (--library), alternating in one process.

    .venv/bin/python -m benchmarks.bench_decode [--tokens 128] [--threads 2] [--no-http] [--no-fused]
        [--activation-dtype fp32,int8]
    .venv/bin/python -m benchmarks.bench_decode --no-http --no-llama --context 4096
    .venv/bin/python -m benchmarks.bench_decode --products [--library OTHER_BUILD.so ...]

Prints JSON lines. The CPU is shared: compare figures within one run.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

MIB = 1 << 20


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def read_bandwidth_gb_s(mib: int = 256) -> float:
    import torch
    a = torch.ones(mib * MIB // 4)
    a.sum()
    best = min(_timed(a.sum) for _ in range(5))
    return a.numel() * 4 / best / 1e9


def fma_g_s(threads: int) -> tuple[float, int] | None:
    """This CPU's fp32 FMA ceiling: 16-lane FMAs (two 8-lane ones with AVX2) a second, in billions, summed over
    `threads` threads each pinned to its own CPU (benchmarks/fma_peak.cpp), and the lanes; None without g++."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    if shutil.which("g++") is None:
        return None
    source = Path(__file__).with_name("fma_peak.cpp")
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "fma_peak"
        try:
            subprocess.run(["g++", "-O2", "-march=native", "-pthread", "-o", str(binary), str(source)], check=True,
                           capture_output=True)
            lines = subprocess.run([str(binary), str(threads)], check=True, capture_output=True,
                                   text=True).stdout.split()
        except subprocess.CalledProcessError:  # g++ could not build it for this CPU
            return None
    rows = [lines[i:i + 4] for i in range(0, len(lines), 4)]
    return sum(float(r[2]) for r in rows) / 1e9, int(rows[0][1])


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


def engine_breakdown(args, modes: list[bool]) -> dict[bool, dict]:
    """Per mode (True: decode steps' layers fused, False: the per-op path), the figures above, both modes in
    one engine and its model, their timed repeats alternating."""
    import torch
    from reuse_server.engine.builder import build_engine
    from reuse_server.engine.config import EngineConfig
    from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
    from reuse_server.model import cpu_linear, quant_linear

    engine = build_engine(EngineConfig(model=args.model, weight_dtype=args.weight_dtype,
                                       activation_dtype=args.activation_dtype, kv_cache_memory=384 * MIB))
    params = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    prompt = engine.tokenizer.encode("Write a long story about a lighthouse keeper who finds a map in a bottle.")
    if args.context:  # a long context: the decode's attention reads args.context tokens of K/V a layer
        prompt = (prompt * (args.context // len(prompt) + 1))[:args.context]
    runner = engine.runner
    model = runner.model

    def use(fused: bool) -> None:
        if model.use_fused_decode(fused) != fused:
            raise SystemExit(f"the fused decode does not run {args.weight_dtype} weights here (try --no-fused)")

    def decode_steps(tag: str, n: int, streams: int = 1) -> float:
        tags = [tag] if streams == 1 else [f"{tag}-{i}" for i in range(streams)]
        for i, t in enumerate(tags):  # several streams: each its own prompt, as the served 8 streams have
            ids = prompt
            if streams > 1:  # as long as the one stream's prompt, its end made its own
                suffix = engine.tokenizer.encode(f" (Version {i + 1}.)")
                ids = prompt[:max(1, len(prompt) - len(suffix))] + suffix
            engine.add_request(t, ids, params, CacheOptions(prefix_cache=False))
        for _ in range(4):  # prefill and a few warm steps
            engine.step()
        start = time.perf_counter()
        for _ in range(n):
            engine.step()
        elapsed = time.perf_counter() - start
        for t in tags:
            engine.abort(t)
        return elapsed / n

    forward_seconds = [0.0]
    original_run = runner.run

    def timed_run(*a, **kw):
        start = time.perf_counter()
        try:
            return original_run(*a, **kw)
        finally:
            forward_seconds[0] += time.perf_counter() - start

    runner.run = timed_run
    steps, forwards = {m: [] for m in modes}, {m: [] for m in modes}
    for i in range(args.repeats):
        for fused in modes if i % 2 == 0 else modes[::-1]:
            use(fused)
            forward_seconds[0] = 0.0
            steps[fused].append(decode_steps(f"plain{i}-{fused}", args.tokens))
            forwards[fused].append(forward_seconds[0] / (args.tokens + 4))  # the 4 warm-up steps ran through it too
    runner.run = original_run

    rows = {}
    for fused in modes:
        use(fused)
        best = min(range(args.repeats), key=steps[fused].__getitem__)  # the run the shared CPU disturbed least
        rows[fused] = dict(step_ms=round(1e3 * steps[fused][best], 2),
                           forward_ms=round(1e3 * forwards[fused][best], 2))
        rows[fused].update(timed_parts(args, engine, decode_steps, forwards[fused][best], f"timed-{fused}"))

    # 8 streams in one step, as 8 served streams decode: the step, its fused layers, its head (after a short
    # prompt: 8 long contexts would not fit the pool)
    if True in modes and not args.context:
        use(True)
        rows[True]["step_ms_b8"] = round(1e3 * min(decode_steps(f"eight{i}", args.tokens, 8)
                                                   for i in range(args.repeats)), 2)
        from reuse_server.model import fused_decode, llama
        timers = Timers()
        timers.wrap(fused_decode.FusedDecode, "run", "fused_layers")
        timers.wrap(llama.LlamaModel, "compute_logits", "head")
        decode_steps("eight-timed", args.tokens, 8)
        timers.restore()
        for part in ("fused_layers", "head"):
            rows[True][f"{part}_ms_b8"] = round(1e3 * timers.seconds[part] / (args.tokens + 4), 2)

    kernels = (quant_linear.NativeQuantLinear, cpu_linear.NativeLinear)
    for row in rows.values():
        row["linear_calls_per_step"] = sum(isinstance(m, kernels) for m in model.modules()) + (
            model.packed_head is not None)
        row["threads"] = torch.get_num_threads()
    return rows


def timed_parts(args, engine, decode_steps, forward_s: float, tag: str) -> dict:
    """One more decode pass with timers around the parts (module docstring); fused_layers: the fused decode's
    layers (in the per-op path: linear, attention, kv_write and norm_rope instead)."""
    from reuse_server.engine.detokenizer import IncrementalDetokenizer
    from reuse_server.kv.pool import KVPool
    from reuse_server.model import cpu_attention, cpu_linear, cpu_ops, fused_decode, llama, quant_linear

    timers = Timers()
    timers.wrap(quant_linear.NativeQuantLinear, "forward", "linear")
    timers.wrap(cpu_linear.NativeLinear, "forward", "linear")  # --weight-dtype fp32
    timers.wrap(cpu_attention.CpuAttentionKernel, "__call__", "attention")
    timers.wrap(cpu_attention, "KernelPlan", "attention")
    timers.wrap(KVPool, "write", "kv_write")
    timers.wrap(llama.RMSNorm, "forward", "norm_rope")
    timers.wrap(llama, "apply_rotary", "norm_rope")
    timers.wrap(cpu_ops.NativeOps, "silu_mul", "norm_rope")
    timers.wrap(cpu_ops.NativeOps, "gelu_mul", "norm_rope")
    timers.wrap(fused_decode.FusedDecode, "run", "fused_layers")
    timers.wrap(llama.LlamaModel, "embed", "embed")
    timers.wrap(engine.runner, "run", "forward")
    timers.wrap(engine.sampler, "pick", "sampler")  # what the engine calls: sampling and its one host copy
    timers.wrap(engine.scheduler, "schedule", "scheduler")
    timers.wrap(engine.scheduler, "update", "scheduler")
    timers.wrap(IncrementalDetokenizer, "add", "detokenizer")
    timers.wrap(engine, "step", "step")
    decode = engine.runner.model.backend.decode
    calls = decode.calls if decode is not None else 0
    decode_steps(tag, args.tokens)
    timers.restore()
    per = defaultdict(float, {k: 1e3 * v / args.tokens for k, v in timers.seconds.items()})
    parts = ("linear", "attention", "kv_write", "norm_rope", "fused_layers", "embed")
    return dict(
        **{f"{part}_ms": round(per[part], 2) for part in parts},
        python_dispatch_ms=round(1e3 * forward_s - sum(per[part] for part in parts), 2),
        scheduler_ms=round(per["scheduler"] - per["detokenizer"], 3), sampler_ms=round(per["sampler"], 3),
        detokenizer_ms=round(per["detokenizer"], 3),
        instrumented_step_ms=round(per["step"], 2),
        fused_steps=(decode.calls - calls if decode is not None else 0))


def product_figures(args) -> list[dict]:
    """The model's one-row products of one real decode step (their inputs recorded), replayed through each
    kernel library (--library: another build of the kernels, e.g. an earlier commit's, for an A/B in one
    process; by default this tree's) on 1 and on --threads threads, alternating, median of --rounds."""
    import ctypes
    import torch
    from reuse_server.engine.builder import build_engine
    from reuse_server.engine.config import EngineConfig
    from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
    from reuse_server.model import native, quant_linear

    engine = build_engine(EngineConfig(model=args.model, weight_dtype=args.weight_dtype,
                                       activation_dtype=args.activation_dtype, kv_cache_memory=384 * MIB))
    prompt = engine.tokenizer.encode("Write a long story about a lighthouse keeper who finds a map in a bottle.")
    engine.add_request("p", prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
                       CacheOptions(prefix_cache=False))
    for _ in range(6):
        engine.step()
    calls, original = [], quant_linear.NativeQuantLinear.forward

    def record(self, x):
        calls.append((self, x.clone()))
        return original(self, x)

    quant_linear.NativeQuantLinear.forward = record
    engine.step()
    quant_linear.NativeQuantLinear.forward = original
    libraries = {"this tree": native.load().kv_quant_linear_f32}
    for path in args.library:
        fn = ctypes.CDLL(path).kv_quant_linear_f32
        fn.argtypes, fn.restype = native.SIGNATURES["kv_quant_linear_f32"]
        libraries[path] = fn
    outputs = {name: [torch.empty(x.shape[0], m.out_features) for m, x in calls] for name in libraries}

    def replay(name, threads):
        fn, ys = libraries[name], outputs[name]
        start = time.perf_counter()
        for (m, x), y in zip(calls, ys):
            fn(x.data_ptr(), x.shape[0], x.stride(0), m.in_features, *m.kernel_weights, y.data_ptr(), threads)
        return time.perf_counter() - start

    configs = [(name, t) for name in libraries for t in sorted({1, args.threads})]
    seconds = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in configs if r % 2 else configs[::-1]:
            seconds[c].append(replay(*c))
    first = outputs["this tree"]
    same = {name: all(torch.equal(a, b) for a, b in zip(first, ys)) for name, ys in outputs.items()}
    return [dict(bench="decode_products", library=name, threads=t, products=len(calls),
                 median_ms=round(1e3 * statistics.median(seconds[(name, t)]), 2),
                 min_ms=round(1e3 * min(seconds[(name, t)]), 2), same_bits_as_this_tree=same[name])
            for name, t in configs]


def decode_over_http(args, url: str, model: str, streams: int, tokens: int, cpu: list[float] | None = None) -> float:
    """Mean per-stream ms/token of `streams` concurrent streams, through the --client: "lean" reads raw SSE in
    one event loop (bench_weights.decode_lean), "openai" runs the SDK in a thread a stream (bench_weights.decode),
    whose per-chunk CPU (~0.4 ms) lands on the cores the server decodes on. cpu: if given, gets the client's CPU
    seconds while streaming appended."""
    from benchmarks import bench_weights

    if args.client == "openai":
        import openai
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1200)
        start = time.process_time()
        ms = bench_weights.decode(client, model, streams, tokens)
        if cpu is not None:
            cpu.append(time.process_time() - start)
        return ms
    return bench_weights.decode_lean(url, model, streams, tokens, cpu)


@contextmanager
def our_server(args, fused: bool) -> Iterator[tuple[str, str, subprocess.Popen]]:
    """(URL, model name, process) of our server on the bundled model with the run's weights and activations,
    the fused decode on or off, warmed by one short stream (lazy initialisation out of the way)."""
    from benchmarks.bench_ttft import server_process, served_model
    from reuse_server.model.fused_decode import ENV

    os.environ[ENV] = "1" if fused else "0"  # the server's model reads it as it packs its weights
    with server_process("--model", args.model, "--weight-dtype", args.weight_dtype, "--activation-dtype",
                        args.activation_dtype, "--kv-cache-memory", "384MiB") as (url, proc):
        model = served_model(url)
        decode_over_http(args, url, model, 1, 4)
        yield url, model, proc


def http_figures(args, fused: bool) -> dict:
    with our_server(args, fused) as (url, model, proc):
        one = min((served_cpu(args, url, model, proc.pid, 1) for _ in range(args.repeats)), key=lambda r: r[0])
        eight = served_cpu(args, url, model, proc.pid, 8)
    row = dict(http_ms_b1=round(one[0], 2), http_ms_b8=round(eight[0], 2), client=args.client)
    for streams, (_, loop_ms, client_ms) in ((1, one), (8, eight)):
        row[f"server_loop_cpu_ms_b{streams}"] = round(loop_ms, 2)
        row[f"client_cpu_ms_b{streams}"] = round(client_ms, 2)
    return row


def served_cpu(args, url: str, model: str, pid: int, streams: int) -> tuple[float, float, float]:
    """decode_over_http's ms per token, and the CPU each step of those streams cost the server's event loop
    (its main thread: the API, SSE and HTTP work, on the cores the engine decodes on) and this client, in ms."""
    import psutil

    def loop_seconds() -> float:
        return next(t.user_time + t.system_time for t in psutil.Process(pid).threads() if t.id == pid)

    loop, client = loop_seconds(), []
    ms = decode_over_http(args, url, model, streams, args.tokens, client)
    steps = args.tokens
    return ms, 1e3 * (loop_seconds() - loop) / steps, 1e3 * client[0] / steps


def llama_server_figures(args) -> dict | None:
    """llama.cpp's server on the same GGUF and threads, through the same client code (bench_weights): one
    stream on one slot, then 8 streams on 8 slots; None where `llama-server` is not on PATH."""
    import shutil
    from benchmarks.bench_ttft import served_model
    from benchmarks.bench_weights import llama_server
    from reuse_server.model.loader import bundled_gguf_path

    binary = shutil.which("llama-server")
    if binary is None:
        return None
    gguf = bundled_gguf_path(args.model)
    row = dict(bench="decode_llama_server", gguf=gguf.name, threads=args.threads, client=args.client)
    for slots, key in ((1, "http_ms_b1"), (8, "http_ms_b8")):
        with llama_server(binary, gguf, args.threads, slots, slots * 1024) as (url, _proc):
            model = served_model(url)
            decode_over_http(args, url, model, 1, 4)
            runs = [decode_over_http(args, url, model, slots, args.tokens)
                    for _ in range(args.repeats if slots == 1 else 1)]
            row[key] = round(min(runs), 2)
    return row


def head_to_head(args) -> dict | None:
    """Our server (the fused decode) and llama-server (one slot, the same GGUF and threads) up at once, idle
    but for the stream being measured: in each of --turns turns, our one stream, llama-server's one stream, then
    our 8 streams. The ratios are of the medians of one run's turns, so a drift of the shared VM between two
    servers' runs (minutes apart in http_figures and llama_server_figures) lands on both sides alike. None where
    `llama-server` is not on PATH."""
    import shutil
    from benchmarks.bench_ttft import served_model
    from benchmarks.bench_weights import llama_server
    from reuse_server.model.loader import bundled_gguf_path

    binary = shutil.which("llama-server")
    if binary is None:
        return None
    ours_1, ours_8, llama_1 = [], [], []
    with our_server(args, fused=True) as (url, model, _proc), \
            llama_server(binary, bundled_gguf_path(args.model), args.threads, 1, 1024) as (llama_url, _llama):
        llama_model = served_model(llama_url)
        decode_over_http(args, llama_url, llama_model, 1, 4)
        for _ in range(args.turns):
            ours_1.append(decode_over_http(args, url, model, 1, args.tokens))
            llama_1.append(decode_over_http(args, llama_url, llama_model, 1, args.tokens))
            ours_8.append(decode_over_http(args, url, model, 8, args.tokens))
    median = statistics.median
    return dict(bench="decode_head_to_head", weight_dtype=args.weight_dtype, activation_dtype=args.activation_dtype,
                tokens=args.tokens, turns=args.turns, client=args.client,
                ours_ms_b1=[round(x, 2) for x in ours_1], llama_ms_b1=[round(x, 2) for x in llama_1],
                ours_ms_b8=[round(x, 2) for x in ours_8],
                ours_ms_b1_median=round(median(ours_1), 2), llama_ms_b1_median=round(median(llama_1), 2),
                ours_ms_b8_median=round(median(ours_8), 2),
                llama_over_ours_b1=round(median(llama_1) / median(ours_1), 2),
                b8_over_b1=round(median(ours_8) / median(ours_1), 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2", help="a bundled model: smollm2, or gemma3-270m (its weights: "
                    "--weight-dtype auto)")
    ap.add_argument("--weight-dtype", default="int4")
    ap.add_argument("--activation-dtype", default="fp32,int8",
                    help="comma-separated --activation-dtype settings to run, each its own rows (int8: integer "
                         "products, logits not fp32 activations')")
    ap.add_argument("--context", type=int, default=0,
                    help="in process: decode after a prompt of this many tokens (default: one short sentence)")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--client", choices=("lean", "openai"), default="lean",
                    help="the HTTP client of the served rows, ours and llama-server's (decode_over_http)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-server even when it is on PATH")
    ap.add_argument("--no-fused", action="store_true",
                    help="only the per-op path (by default a row for the fused decode, then one for the per-op path)")
    ap.add_argument("--products", action="store_true",
                    help="only time one step's quantized products on 1 and --threads threads (product_figures)")
    ap.add_argument("--library", action="append", default=[],
                    help="with --products: another build of the kernels to compare in the same run (repeatable)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--turns", type=int, default=7,
                    help="turns of head_to_head: our one stream, llama-server's, our 8 streams; 0 skips it")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported, and for the server
    from reuse_server.server.openmp import apply_short_spin
    apply_short_spin()
    import torch
    torch.set_num_threads(args.threads)
    if args.products:
        for row in product_figures(args):
            emit(**row)
        return
    modes = [False] if args.no_fused else [True, False]
    read_gb_s = round(read_bandwidth_gb_s(), 1)
    fma = fma_g_s(args.threads)
    settings = args.activation_dtype.split(",")
    for activation_dtype in settings:
        if activation_dtype not in ("fp32", "int8"):
            raise SystemExit(f"unknown activation dtype {activation_dtype!r}: fp32 or int8")
    for activation_dtype in settings:
        run = argparse.Namespace(**{**vars(args), "activation_dtype": activation_dtype})
        rows = engine_breakdown(run, modes)
        for fused in modes:
            row = dict(bench="decode_breakdown", model=args.model, weight_dtype=args.weight_dtype,
                       activation_dtype=activation_dtype,
                       tokens=args.tokens, fused=fused, context=args.context or None, read_gb_s=read_gb_s,
                       fma_g_s=None if fma is None else round(fma[0], 2), fma_lanes=None if fma is None else fma[1],
                       **rows[fused])
            if not args.no_http:
                row.update(http_figures(run, fused))
                row["http_overhead_ms"] = round(row["http_ms_b1"] - row["step_ms"], 2)
            emit(**row)
        if not args.no_http and not args.no_llama and args.turns > 0:
            emit(**(head_to_head(run) or dict(bench="decode_head_to_head", skipped="llama-server not on PATH")))
    if not args.no_http and not args.no_llama:
        emit(**(llama_server_figures(args) or dict(bench="decode_llama_server", skipped="not on PATH")))


if __name__ == "__main__":
    main()
