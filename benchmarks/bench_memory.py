"""Server memory under concurrent load: does it stay at weights + the KV pool (allocated once at start-up
from --kv-cache-memory) plus a bounded overhead?

Starts the server on the bundled SmolLM2, samples its resident set size (psutil) while rounds of
concurrent streaming chat requests with ~1k-token prompts run, and prints JSON lines: the weights' bytes
(the bytes of the safetensors the server loads, read from their headers), the pool's bytes
(/metrics kvreuse_kv_blocks_total x bytes per block), RSS after start-up, peak RSS under load, the
kernel's high-water mark (VmHWM, which also covers model loading), and overhead = peak - weights - pool,
split into the idle footprint's share (RSS after one short request) and what the load adds on top.
The weights' share is the bytes of the folder the server loads for --weight-dtype (fp32 by default here;
the server's own default, `auto`, is int4 on the bundled model): they are held as stored.

It also accounts for the idle footprint: a fresh interpreter imports what the server imports, in its order,
and loads the tokenizer and the native kernels, printing resident (RSS) and private (USS) memory after each
step (`memory_imports` rows); the idle server's mappings are split into anonymous memory (heap, Python
objects, weights, pool, allocator slack) and the shared libraries' pages (`memory_maps`); `memory_split`
puts the two together: runtime imports, tokenizer, weights, pool, and the rest (engine state and allocator
slack, what no import or tensor above accounts for).

    .venv/bin/python -m benchmarks.bench_memory [--concurrency 8] [--prompt-tokens 1024] [--rounds 3]
        [--weight-dtype int4 --kv-cache-memory 384MiB]
"""
from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open

from benchmarks.bench_ttft import DOCS, REPO, TextSource, conversation, served_model, server_process

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
MIB = 1 << 20


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def checkpoint_weights(folder: Path) -> tuple[int, int]:
    """(parameters, bytes as stored) over the folder's safetensors files, read from their headers."""
    params = stored = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                numel = 1
                for dim in piece.get_shape():
                    numel *= dim
                params += numel
                stored += numel * DTYPE_BYTES[piece.get_dtype()]
    return params, stored


def kv_bytes_per_block(config: dict, block_size: int, element_bytes: int) -> int:
    """K and V, every layer, block_size tokens (the layout of reuse_server.kv.pool.KVPool)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return 2 * config["num_hidden_layers"] * block_size * kv_heads * head_dim * element_bytes


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def proc_status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile from /proc/<pid>/status, in bytes (Linux only; empty elsewhere)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile") and value.strip().endswith("kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """Rss, Pss, USS (private clean + dirty) and Anonymous from /proc/<pid>/smaps_rollup, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[key] = int(value.split()[0]) * 1024
    return {"rss": fields["Rss"], "pss": fields["Pss"], "anon": fields["Anonymous"],
            "uss": fields["Private_Clean"] + fields["Private_Dirty"]}


# What the server holds before it takes a request, step by step in the order `reuse-server serve` gets
# there (reuse_server/server/cli.py, then engine/builder.py): each step's imports are those not already in.
IMPORT_STEPS = [
    ("python", ""),
    ("torch", "from reuse_server.server.openmp import apply_short_spin; apply_short_spin(); import torch"),
    ("fastapi, uvicorn, pydantic", "import fastapi, uvicorn, pydantic"),
    ("prometheus_client", "import prometheus_client"),
    ("jinja2", "import jinja2"),
    ("the server's modules (api, engine)", "import reuse_server.api.app, reuse_server.engine.async_engine, "
                                           "reuse_server.server.serving, reuse_server.server.cli"),
    ("safetensors (loading)", "import safetensors.torch"),
    # model/quant_linear.choose_cpu_kernel times the candidate kernels on weights quantized with gguf's quantizer
    ("gguf (the start-up choice of quantized kernel)", "import gguf"),
    ("tokenizers", "import tokenizers"),
    # what loading freed goes back to the system, as the server's start-up ends (engine/builder.py)
    ("tokenizer", "from reuse_server.model.loader import load_tokenizer, resolve_model; "
                  "from reuse_server.engine.builder import _return_freed_memory; "
                  "tok = load_tokenizer(resolve_model({model!r}, {weight_dtype!r})); _return_freed_memory()"),
    ("native kernels", "from reuse_server.model import native; native.load()"),
]
# Not on the idle server's path, measured after the steps above for what they would cost.
OFF_PATH_STEPS = [
    ("redis, zmq, msgpack (KV tiers, KV events: only when configured)", "import redis, zmq, msgpack"),
    ("httpx (the cluster command's client)", "import httpx"),
    ("xgrammar (first structured-output request)", "import xgrammar"),
    ("transformers' tokenizer (xgrammar reads it: first structured-output request)",
     "getattr(tok, 'transformers_tokenizer', lambda: tok)(); _return_freed_memory()"),
    ("transformers model configs (AutoConfig of a llama)", "import transformers.models.llama.configuration_llama"),
    ("torch._dynamo (torch.compile; meta-device reference ops)", "import torch._dynamo"),
]
# the last step before the tokenizer: what the interpreter holds with every module a server imports
RUNTIME_STEP = "tokenizers"


def measure_imports(model: str, weight_dtype: str) -> list[dict]:
    """Runs IMPORT_STEPS then OFF_PATH_STEPS in a fresh interpreter; one row per step, memory after it."""
    # the child defines smaps_rollup itself: importing this module would import its own dependencies first
    script = ["import json, sys", "from pathlib import Path", inspect.getsource(smaps_rollup),
              "def report(step, on_path):",
              "    print(json.dumps({'step': step, 'on_path': on_path, 'modules': len(sys.modules), "
              "**smaps_rollup()}), flush=True)"]
    for steps, on_path in ((IMPORT_STEPS, True), (OFF_PATH_STEPS, False)):
        for name, code in steps:
            script += [code.format(model=model, weight_dtype=weight_dtype) or "pass",
                       f"report({name!r}, {on_path})"]
    out = subprocess.run([sys.executable, "-c", "\n".join(script)], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def mapping_groups(pid: int) -> dict[str, int]:
    """The process's resident bytes by what backs them: anonymous memory (the brk heap, other private
    mappings: Python's object arenas, malloc's thread arenas, the tensors) and the shared libraries' pages,
    grouped by package (torch, triton, ...), from /proc/<pid>/smaps."""
    groups: dict[str, int] = {}
    name = "anonymous"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head[0].endswith(":"):  # a mapping's first line: address range, perms, offset, dev, inode, path
            path = head[5] if len(head) > 5 else ""
            if path in ("", "[heap]") or path.startswith("[anon"):
                name = "anonymous"
            elif "/site-packages/" in path:
                name = "libraries: " + path.split("/site-packages/")[1].split("/")[0].removesuffix(".libs")
            elif path.startswith("["):
                name = "other"
            else:
                name = "libraries: python and system" if ".so" in path else "other files"
        elif head[0] == "Rss:":
            groups[name] = groups.get(name, 0) + int(head[1]) * 1024
    return groups


class RssSampler:
    """Polls a process's RSS on a thread and keeps the largest value seen."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.process = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
                self.samples += 1
            except psutil.Error:
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def stream_chat(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> int:
    """Run one streaming request to the end; returns its prompt tokens."""
    usage = None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True}, temperature=0,
                                                extra_body={"ignore_eos": True}):
        usage = chunk.usage or usage
    return usage.prompt_tokens


def emit_split(imports: list[dict], maps: dict[str, int], rollup: dict[str, int], idle: int, weights: int,
               pool: int) -> None:
    """The idle footprint accounted for: the fresh interpreter's steps (each one's RSS and USS added), the
    idle server's mappings, and idle RSS = runtime + tokenizer + kernels + weights + pool + the rest."""
    before = {"rss": 0, "uss": 0}
    for row in imports:
        if row["step"] == IMPORT_STEPS[-1][0]:
            on_path_end = row
        emit(bench="memory_imports", step=row["step"], on_path=row["on_path"], modules=row["modules"],
             rss=mib(row["rss"]), uss=mib(row["uss"]), anon=mib(row["anon"]),
             added_rss=mib(row["rss"] - before["rss"]), added_uss=mib(row["uss"] - before["uss"]))
        before = row
    emit(bench="memory_maps", **{name: mib(size) for name, size in sorted(maps.items(), key=lambda kv: -kv[1])
                                 if size >= 1 << 20}, uss=mib(rollup["uss"]), pss=mib(rollup["pss"]))
    by_step = {row["step"]: row["rss"] for row in imports}
    runtime = by_step[RUNTIME_STEP]
    tokenizer = by_step["tokenizer"] - runtime
    kernels = by_step["native kernels"] - by_step["tokenizer"]
    # The steps' RSS holds the libraries' pages as a fresh interpreter has them; the server pages out, after
    # start-up, those no other process maps (server/library_pages.py): what it holds of them less.
    paged_out = (on_path_end["rss"] - on_path_end["anon"]) - sum(size for name, size in maps.items()
                                                                   if name.startswith("libraries: "))
    rest = idle - runtime - tokenizer - kernels - weights - pool + paged_out
    emit(bench="memory_split", idle_rss=mib(idle), python_and_imports=mib(runtime), tokenizer=mib(tokenizer),
         native_kernels=mib(kernels), weights=mib(weights), pool=mib(pool), library_pages_paged_out=mib(paged_out),
         rest=mib(rest), overhead=mib(idle - weights - pool), on_path_imports_rss=mib(on_path_end["rss"]))


def mib(n: int) -> float:
    return round(n / MIB, 1)


def prepare(args) -> dict:
    """The model's weight and KV block sizes, and the run's conversations: the warm-up's, then each round's."""
    from transformers import AutoTokenizer

    from reuse_server.model.loader import resolve_model

    folder = resolve_model(args.model, args.weight_dtype)
    config = json.loads((folder / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    source = TextSource(tokenizer)
    params, stored = checkpoint_weights(folder)
    element = 4  # the server runs float32 on the CPU (--dtype auto)
    warm = conversation(tokenizer, source, 64, "Hello?")
    prompts = [[conversation(tokenizer, source, args.prompt_tokens, f"Request {r}.{i}: summarize the text.")
                for i in range(args.concurrency)] for r in range(args.rounds)]
    return dict(parameters=params, stored=stored, per_block=kv_bytes_per_block(config, args.block_size, element),
                warm=warm, prompts=prompts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--weight-dtype", default="fp32", help="the server's --weight-dtype (fp32, bf16, int8, int4)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="the server's step budget: the largest batch of activations")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="one more `reuse-server serve` argument, e.g. --serve-arg=--cpu-attention=torch (repeatable)")
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)  # prepare()'s child interpreter
    args = ap.parse_args(argv)
    if args.prepare:
        print(json.dumps(prepare(args)))
        return

    # Everything that needs the model's folder or its tokenizer comes from a child interpreter: they import
    # torch (transformers, the loader), and while this process maps torch's libraries the server cannot page
    # them out after start-up (the kernel leaves pages another process maps), which put ~60 MiB of this
    # driver's doing into the server's idle RSS.
    prep = json.loads(subprocess.run([sys.executable, "-m", "benchmarks.bench_memory", "--prepare",
                                      *(sys.argv[1:] if argv is None else argv)],
                                     check=True, capture_output=True, text=True, cwd=REPO).stdout)
    if "torch" in sys.modules:
        raise SystemExit("bench_memory's driver imported torch: the server's idle RSS would hold its pages")
    params, stored, per_block = prep["parameters"], prep["stored"], prep["per_block"]
    weights = stored  # the folder holds the weights as the server holds them (fp32: 4 bytes a parameter)
    imports = measure_imports(args.model, args.weight_dtype)

    with server_process("--model", args.model, "--weight-dtype", args.weight_dtype,
                        "--kv-cache-memory", args.kv_cache_memory,
                        "--block-size", str(args.block_size),
                        "--max-num-batched-tokens", str(args.max_num_batched_tokens), *args.serve_arg) as (url, proc):
        model = served_model(url)
        blocks = int(metrics(url)["kvreuse_kv_blocks_total"])
        pool = blocks * per_block
        started = psutil.Process(proc.pid).memory_info().rss
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        # one short request touches every weight page (the safetensors file may be memory-mapped) and
        # warms the runtime: RSS then is the idle footprint, and peak - idle is what the load adds
        stream_chat(client, model, prep["warm"], 2)
        idle = psutil.Process(proc.pid).memory_info().rss
        idle_maps, idle_rollup = mapping_groups(proc.pid), smaps_rollup(proc.pid)
        prompts = prep["prompts"]
        t0 = time.perf_counter()
        with RssSampler(proc.pid) as sampler, ThreadPoolExecutor(args.concurrency) as pool_threads:
            prompt_tokens = []
            for round_prompts in prompts:  # each round: all requests at once, the next round after they end
                prompt_tokens += pool_threads.map(lambda m: stream_chat(client, model, m, args.max_tokens),
                                                  round_prompts)
        load_s = time.perf_counter() - t0
        status = proc_status(proc.pid)
        after = metrics(url)

    peak = sampler.peak
    emit(bench="memory", model=model, weight_dtype=args.weight_dtype, parameters=params, weights_bytes=weights,
         checkpoint_stored_bytes=stored,
         kv_blocks=blocks, kv_bytes_per_block=per_block, pool_bytes=pool, rss_after_start_bytes=started,
         rss_idle_bytes=idle, peak_rss_bytes=peak, load_added_bytes=peak - idle,
         overhead_bytes=peak - weights - pool, vmhwm_bytes=status.get("VmHWM"),
         rss_anon_end_bytes=status.get("RssAnon"), rss_file_end_bytes=status.get("RssFile"),
         rss_samples=sampler.samples)
    emit(bench="memory_mib", weight_dtype=args.weight_dtype, weights=round(weights / MIB, 1), pool=round(pool / MIB, 1),
         rss_after_start=round(started / MIB, 1), rss_idle=round(idle / MIB, 1), peak_rss=round(peak / MIB, 1),
         idle_overhead=round((idle - weights - pool) / MIB, 1), load_added=round((peak - idle) / MIB, 1),
         overhead=round((peak - weights - pool) / MIB, 1),
         vmhwm=round(status["VmHWM"] / MIB, 1) if "VmHWM" in status else None)
    emit_split(imports, idle_maps, idle_rollup, idle, weights, pool)
    emit(bench="memory_load", concurrency=args.concurrency, rounds=args.rounds, requests=len(prompt_tokens),
         mean_prompt_tokens=round(sum(prompt_tokens) / len(prompt_tokens)), max_tokens=args.max_tokens,
         max_num_batched_tokens=args.max_num_batched_tokens,
         load_s=round(load_s, 2), generation_tokens=after.get("kvreuse_generation_tokens_total"),
         preemptions=after.get("kvreuse_preemptions_total"), source="lee_background.cor" if DOCS.exists() else "filler")


if __name__ == "__main__":
    main()
