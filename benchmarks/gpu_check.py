"""`make gpu-check`: what this server does on a CUDA device, in one run of at most 8 minutes on one H100, as one
JSON (issue #45). Run it at the start of any session whose device status shows a lent machine (DEVELOPERS.md);
its figures go to benchmarks/results/gpu.md and BENCHMARKS.md's summary.

It needs only what the lent machine has (torch with CUDA, triton, pytest, safetensors, tokenizers, xxhash; no
HTTP stack, no model files): models are random weights in the shapes of Llama-3.1-8B and the bundled models
(SmolLM2-135M, Gemma 3 270M), built on the device in bf16. In order:
- `pytest -m cuda` over CUDA_TESTS (the CUDA-marked tests; skipped where no CUDA device is present);
- `device`: the card, torch and triton; `copy`: measured device-to-device copy speed (bytes read + written a
  second, the speed a memory-bound kernel is held to) and host-to-device from pinned and pageable memory;
- `kernels`: `benchmarks.gpu_check_kernels.kernel_rows(device)` where it exists (each Triton kernel against
  the torch path: max error, time, bytes read), each row that gives `kv_bytes_read` and `seconds` with its read speed
  as a share of the copy speed; else "not built";
- per model shape, `decode`: one decode step (ModelRunner.run and Sampler.sample, as the engine runs them) at
  batch 1/8/32 and 1k/8k context over distinct random KV in the pool, with `bound_ms`, the time the step's
  weight and KV bytes take at the measured copy speed (the goal: within 1.3x at batch 32, 8k, on the 8B);
- per model shape, `decode_graphs`: --cuda-graphs on against off, a decode step at batch 1 and 8 and the
  shortest context eager on the static buffers and replayed from its bucket's graph, the capture's seconds and
  device memory, and whether both sampled the same tokens (the flag stays off by default until this is read);
- per model shape, `engine` (LLMEngine.step, as the server's engine thread runs it): cold and warm time to
  first token of an 8k prompt (warm: the same prompt again, a prefix hit), and an 8k prompt of four
  precomputed chunks in another order, blended, against its full prefill;
- `peak_memory_gib` per section (torch.cuda.max_memory_allocated).
A section that fails is recorded with its error and the run goes on; the exit status is non-zero if any did.

Without a CUDA device it says so and exits 2. `--dry-run` runs the same code on the CPU at tiny shapes (tests
run it, so the script does not rot) and exits 0 when every section ran.

    python3 -m benchmarks.gpu_check [--out gpu_check.json] [--dry-run] [--only llama-3.1-8b]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

CUDA_TESTS = ["tests/cuda"]  # where the CUDA-marked tests live (pytest -m cuda runs them)
SEED = 45
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# config.json of each shape, as their checkpoints give it (the bundled models' as converted from their GGUFs)
SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "gemma3-270m": dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
        rope_parameters={"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                         "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
        max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106]),
}
# --dry-run: each family at a size the CPU runs in seconds
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
TINY_LAYERS = {"llama-3.1-8b": 2, "smollm2-135m": 2, "gemma3-270m": 6}


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]  # decode contexts
    prompt: int  # the TTFT and blending prompts' length
    copy_bytes: int
    decode_repeats: int


FULL = Sizes(batches=(1, 8, 32), contexts=(1024, 8192), prompt=8192, copy_bytes=1 << 30, decode_repeats=10)
DRY = Sizes(batches=(1, 8, 32), contexts=(64, 256), prompt=256, copy_bytes=8 << 20, decode_repeats=2)
BLOCK_SIZE = 16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU at tiny shapes")
    ap.add_argument("--only", default=None, help="comma-separated model shapes (default: all)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device is present (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda or 'none'}): run it on a lent GPU (DEVELOPERS.md), or --dry-run to try the "
              "script on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    sizes = DRY if args.dry_run else FULL
    shapes = args.only.split(",") if args.only else list(SHAPES)
    report: dict = {"dry_run": args.dry_run, "seed": SEED, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(f"gpu-check: seed {SEED}, device {device}", flush=True)
    failed = []

    def section(name, fn, *a):
        start = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            result = fn(*a)
        except Exception as exc:  # recorded, and the next section runs: a first GPU run should tell all it can
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
            failed.append(name)
        if isinstance(result, dict):
            result["seconds"] = round(time.perf_counter() - start, 2)
            if device.type == "cuda":
                result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        shown = {k: v for k, v in result.items() if k != "loaded"} if isinstance(result, dict) else result
        print(f"gpu-check: {name}: {json.dumps(shown)[:600]}", flush=True)
        return result

    report["cuda_tests"] = section("cuda_tests", cuda_tests)
    if report["cuda_tests"].get("returncode") not in (0, 5, None):  # 5: none collected
        failed.append("cuda_tests")
    report["device"] = section("device", device_info, device)
    report["copy"] = section("copy", copy_speed, device, sizes.copy_bytes)
    copy_bps = report["copy"].get("device_copy_gb_s", 0) * 1e9
    report["kernels"] = section("kernels", kernels, device, copy_bps)
    report["models"] = {}
    for name in shapes:
        model_report = report["models"][name] = {}
        built = section(f"{name}: build", build, name, device, args.dry_run)
        if "error" in built:
            model_report["build"] = built
            continue
        loaded = built.pop("loaded")
        model_report["build"] = built
        model_report["decode"] = section(f"{name}: decode", decode_grid, loaded, device, sizes, copy_bps)
        model_report["decode_graphs"] = section(f"{name}: decode graphs", decode_graphs, loaded, device, sizes)
        model_report["engine"] = section(f"{name}: engine", engine_figures, loaded, device, sizes)
        del loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["failed_sections"] = failed
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpu-check: wrote {args.out}; {'failed: ' + ', '.join(failed) if failed else 'every section ran'}")
    return 1 if failed else 0


# ---- sections ------------------------------------------------------------------------------------------------

def cuda_tests() -> dict:
    """The CUDA-marked tests, in a subprocess (their own failures stay theirs)."""
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", *CUDA_TESTS]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"returncode": done.returncode, "summary": lines[-1] if lines else done.stderr[-300:],
            "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20]}


def device_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def timed(fn, device: torch.device, repeats: int, warmups: int = 2) -> list[float]:
    """Seconds of each of `repeats` calls of fn after `warmups`, the device synchronized around each."""
    for _ in range(warmups):
        fn()
    out = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - start)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_speed(device: torch.device, nbytes: int) -> dict:
    """Device-to-device copy (bytes read + written a second: a memory-bound kernel's ceiling), and host to
    device from pinned and pageable memory (tier loads)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(generator=None)
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src), device, 10))
    out = {"bytes": nbytes, "device_copy_gb_s": round(2 * nbytes / best / 1e9, 1)}
    if device.type == "cuda":
        host = min(nbytes, 256 << 20)
        for kind, pinned in (("pinned", True), ("pageable", False)):
            h = torch.empty(host, dtype=torch.uint8, pin_memory=pinned)
            d = torch.empty(host, dtype=torch.uint8, device=device)
            t = min(timed(lambda: d.copy_(h, non_blocking=pinned), device, 5))
            out[f"host_to_device_{kind}_gb_s"] = round(host / t / 1e9, 1)
    return out


def kernels(device: torch.device, copy_bps: float) -> dict:
    """Each kernel against the torch path, from the kernels' own bench module where it exists."""
    try:
        from benchmarks.gpu_check_kernels import kernel_rows
    except ImportError as exc:
        return {"status": "kernels: not built", "why": str(exc)}
    rows = kernel_rows(device)
    for row in rows:
        if copy_bps and row.get("bytes_moved") and row.get("seconds"):  # the pool's kernels read and write
            speed = row["bytes_moved"] / row["seconds"]
            row["moved_gb_s"] = round(speed / 1e9, 1)
            row["share_of_copy_speed"] = round(speed / copy_bps, 3)  # a copy's speed counts what it reads and writes
        elif copy_bps and row.get("kv_bytes_read") and row.get("seconds"):
            speed = row["kv_bytes_read"] / row["seconds"]
            row["read_gb_s"] = round(speed / 1e9, 1)
            row["share_of_copy_speed"] = round(speed / (copy_bps / 2), 3)  # a copy reads half the bytes it moves
    return {"status": "built", "rows": rows}


@dataclass
class Built:
    model: torch.nn.Module
    model_config: object
    tokenizer: object
    weight_bytes: int  # what a decode step reads of the weights: every matrix but the embedding (unless tied)


def build(name: str, device: torch.device, tiny: bool) -> dict:
    from reuse_server.model.config import ModelConfig
    from reuse_server.model.llama import LlamaModel

    hf = dict(SHAPES[name])
    if tiny:
        hf.update(TINY, num_hidden_layers=TINY_LAYERS[name])
        if "layer_types" in hf:
            hf.update(layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2, sliding_window=32)
        hf.update(bos_token_id=1, eos_token_id=2)
    mc = ModelConfig.from_hf(hf)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the server's --dtype auto
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(mc)
    finally:
        torch.set_default_dtype(previous)
    model.reset_rotary(device)
    model.eval().requires_grad_(False)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if mc.tie_word_embeddings or not n.startswith("embed_tokens"))
    built = Built(model, mc, random_tokenizer(mc.vocab_size), weight_bytes)
    return {"loaded": built, "config": {k: v for k, v in hf.items() if k != "layer_types"},
            "dtype": str(dtype).removeprefix("torch."), "weight_gib": round(weight_bytes / 2**30, 2)}


def random_tokenizer(vocab_size: int):
    """A word-level tokenizer with one token per id ("<id>"): the engine detokenizes what a random model
    samples; nothing here is text."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from reuse_server.model.tokenizer import ServedTokenizer

    backend = tokenizers.Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()  # joins the words with spaces
    return ServedTokenizer(backend, {"eos_token": "<2>"}, None, Path(tempfile.gettempdir()))


def random_pool(built: Built, device: torch.device, num_blocks: int):
    """A pool of num_blocks blocks in the model's KV shape, every slot of every layer random KV."""
    from reuse_server.kv import quant as kv_quant
    from reuse_server.kv.pool import KVPool

    mc = built.model_config
    dtype = next(built.model.parameters()).dtype
    pool = KVPool(mc.num_layers, num_blocks, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim,
                  kv_quant.pool_dtype("auto", dtype), str(device), read_dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(SEED)
    chunk = 1 << 16
    for layer in range(mc.num_layers):
        for lo in range(0, pool.num_slots, chunk):
            slots = torch.arange(lo, min(lo + chunk, pool.num_slots), device=device)
            k, v = (torch.randn(len(slots), mc.num_kv_heads, mc.head_dim, generator=gen, device=device, dtype=dtype)
                    for _ in range(2))
            pool.write(layer, slots, k, v)
    return pool


def decode_seqs(mc, batch: int, context: int, per_seq: int) -> list:
    """`batch` sequences of `context` random tokens, each about to decode its last one over blocks of its own
    (sequence i's from block 1 + i * per_seq: block 0 is left out)."""
    from reuse_server.engine.sampling_params import SamplingParams
    from reuse_server.engine.sequence import Sequence

    params = SamplingParams(max_tokens=1, temperature=0.0)
    seqs = []
    for i in range(batch):
        ids = torch.randint(3, mc.vocab_size, (context,), generator=torch.Generator().manual_seed(i)).tolist()
        seq = Sequence(f"decode-{i}", ids, params)
        seq.kv.block_table = list(range(1 + i * per_seq, 1 + i * per_seq + -(-context // BLOCK_SIZE)))
        seq.kv.num_computed = context - 1
        seqs.append(seq)
    return seqs


def decode_grid(built: Built, device: torch.device, sizes: Sizes, copy_bps: float) -> dict:
    """One decode step per (batch, context), each sequence over KV blocks of its own filled with random KV."""
    from reuse_server.engine.runner import ModelRunner
    from reuse_server.engine.sampler import Sampler
    from reuse_server.engine.sampling_params import SamplingParams
    from reuse_server.engine.scheduler import StepSlice

    mc = built.model_config
    per_seq = -(-max(sizes.contexts) // BLOCK_SIZE)
    pool = random_pool(built, device, max(sizes.batches) * per_seq + 1)
    runner, sampler = ModelRunner(built.model, pool, str(device)), Sampler()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rows = []
    for context in sizes.contexts:
        for batch in sizes.batches:
            seqs = decode_seqs(mc, batch, context, per_seq)

            def step():
                logits = runner.run([StepSlice(s, 1) for s in seqs], [True] * batch)
                return sampler.sample(logits, [s.sampling for s in seqs], [params] * batch)

            times = timed(step, device, sizes.decode_repeats)
            kv_bytes = batch * context * pool.bytes_per_token
            row = {"batch": batch, "context": context, "step_ms": round(statistics.median(times) * 1e3, 3),
                   "best_ms": round(min(times) * 1e3, 3), "kv_gib": round(kv_bytes / 2**30, 3)}
            if copy_bps:
                # the step reads every weight byte and every KV byte once; a copy moves half its bytes read
                bound = (built.weight_bytes + kv_bytes) / (copy_bps / 2)
                row.update(bound_ms=round(bound * 1e3, 3), over_bound=round(statistics.median(times) / bound, 2))
            rows.append(row)
            print(f"gpu-check:   decode {row}", flush=True)
    return {"rows": rows, "pool_gib": round(pool.nbytes / 2**30, 2)}


GRAPH_BATCHES = (1, 8)  # --cuda-graphs' rows: the bucket sizes decode steps replay most


def decode_graphs(built: Built, device: torch.device, sizes: Sizes) -> dict:
    """--cuda-graphs on against off: a decode step at batch 1 and 8 and the shortest context, on the static
    buffers eagerly (the Triton attention, as --cuda-graphs off runs it) and replayed from the graph captured
    for its bucket, with the capture's time and device memory and whether both sampled the same tokens. On
    the CPU (--dry-run) the eager rows alone: graphs are CUDA's."""
    from reuse_server.engine.decode_graphs import DecodeGraphs
    from reuse_server.engine.decode_inputs import StaticDecodeInputs
    from reuse_server.engine.runner import ModelRunner
    from reuse_server.engine.sampler import Sampler
    from reuse_server.engine.sampling_params import SamplingParams
    from reuse_server.engine.scheduler import StepSlice
    from reuse_server.model.attention_triton import runs_on

    if not runs_on(device):
        return {"error": f"the Triton attention does not run on {device} here (TRITON_INTERPRET=1 on the CPU)"}
    mc, model = built.model_config, built.model
    context = min(sizes.contexts)
    per_seq = -(-context // BLOCK_SIZE)
    pool = random_pool(built, device, max(GRAPH_BATCHES) * per_seq + 2)  # + block 0 and the scratch block
    previous = model.backend.attention
    model.use_triton_attention()
    try:
        inputs = StaticDecodeInputs(max(GRAPH_BATCHES), per_seq, BLOCK_SIZE, pool.num_blocks - 1, str(device),
                                    (mc.num_heads, mc.num_kv_heads, mc.head_dim))
        runner, sampler = ModelRunner(model, pool, str(device), inputs), Sampler()
        out: dict = {"context": context, "buckets": inputs.buckets}
        if device.type == "cuda":
            start = time.perf_counter()
            graphs = DecodeGraphs.capture(model, pool, inputs)
            out.update(capture_seconds=round(time.perf_counter() - start, 2),
                       capture_mib=round(graphs.memory_bytes / 2**20, 1))
        else:
            graphs, out["graphs"] = None, "CUDA only: the eager rows alone"
        params = SamplingParams(max_tokens=1, temperature=0.0)
        rows = []
        for batch in GRAPH_BATCHES:
            seqs = decode_seqs(mc, batch, context, per_seq)

            def step():
                logits = runner.run([StepSlice(s, 1) for s in seqs], [True] * batch)
                return sampler.sample(logits, [s.sampling for s in seqs], [params] * batch)

            runner.graphs = None
            eager = timed(step, device, sizes.decode_repeats)
            eager_tokens = step()
            row = {"batch": batch, "eager_ms": round(statistics.median(eager) * 1e3, 3)}
            if graphs is not None:
                runner.graphs = graphs
                replayed = timed(step, device, sizes.decode_repeats)
                row.update(graph_ms=round(statistics.median(replayed) * 1e3, 3),
                           speedup=round(statistics.median(eager) / statistics.median(replayed), 2),
                           same_tokens=step() == eager_tokens)
            rows.append(row)
            print(f"gpu-check:   decode graphs {row}", flush=True)
        out["rows"] = rows
        out["steps"] = dict(runner.steps)
        return out
    finally:
        model.backend.attention = previous


def engine_figures(built: Built, device: torch.device, sizes: Sizes) -> dict:
    """Through LLMEngine.step: cold and warm TTFT of one prompt, and blending four precomputed chunks in
    another order against the full prefill of the same prompt."""
    from reuse_server.engine.builder import LoadedModel, build_engine
    from reuse_server.engine.config import EngineConfig
    from reuse_server.engine.sampling_params import CacheOptions, SamplingParams

    mc, n = built.model_config, sizes.prompt
    blocks = 6 * (n // BLOCK_SIZE + 2) + 64  # warm-up, cold/warm, four chunks, the blended and the full prompt
    config = EngineConfig(model=f"gpu-check-{mc.architecture}", device=str(device), num_gpu_blocks=blocks,
                          num_window_blocks=blocks if mc.sliding_window else None, max_num_seqs=4,
                          max_num_batched_tokens=n + 64, max_model_len=4 * n, blend_key_shift=False)
    weight_dtype = "bf16" if device.type == "cuda" else "fp32"
    engine = build_engine(config, LoadedModel(built.model, mc, built.tokenizer, weight_dtype, None))
    gen = torch.Generator().manual_seed(SEED + 1)
    prompt = lambda length: torch.randint(3, mc.vocab_size, (length,), generator=gen).tolist()  # noqa: E731
    greedy = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(request_id, ids, options=None) -> tuple[float, object]:
        sync(device)
        start = time.perf_counter()
        seq = engine.add_request(request_id, ids, greedy, options)
        while not seq.output_ids:
            engine.step()
        seconds = time.perf_counter() - start
        while engine.has_work():
            engine.step()
        return seconds, seq.usage

    ttft("warm-up", prompt(n))  # compiles and autotunes what a first prefill of this length does
    p = prompt(n)
    cold, cold_usage = ttft("cold", p)
    warm, warm_usage = ttft("warm", p)
    out = {"prompt_tokens": n, "cold_ttft_ms": round(cold * 1e3, 2), "warm_ttft_ms": round(warm * 1e3, 2),
           "cold_cached_tokens": cold_usage.cached_tokens, "warm_cached_tokens": warm_usage.cached_tokens}
    question = prompt(32)
    chunk_len = (n - len(question)) // 4 // BLOCK_SIZE * BLOCK_SIZE  # whole blocks: every chunk block reusable
    chunks = [prompt(chunk_len) for _ in range(4)]
    for i, chunk in enumerate(chunks):  # each alone, as POST /v1/cache/chunks files them
        engine.precompute(f"chunk-{i}", chunk, CacheOptions(chunk_spans=[(0, chunk_len)]))
        while engine.has_work():
            engine.step()
    order = [2, 0, 3, 1]
    ids = [t for i in order for t in chunks[i]] + question
    spans = [(k * chunk_len, chunk_len) for k in range(4)]
    blended, blend_usage = ttft("blended", ids, CacheOptions(blend=True, chunk_spans=spans))
    full, _ = ttft("full", ids, CacheOptions(prefix_cache=False))
    out.update(blend_prompt_tokens=len(ids), blended_ttft_ms=round(blended * 1e3, 2),
               full_prefill_ttft_ms=round(full * 1e3, 2), blend_speedup=round(full / blended, 2),
               blended_tokens=blend_usage.blended_tokens, recomputed_tokens=blend_usage.recomputed_tokens)
    engine.close()
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
