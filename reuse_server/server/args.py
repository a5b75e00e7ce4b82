"""The flags of `reuse-server serve` (their types, the parser, and the EngineConfig they make), apart from the
commands that read them: the CLI (cli.py), the replicas a cluster starts (replica_sizing.py) and the Dynamo
worker (dynamo_worker.py) each parse the same serve flags here. Torch-free."""
from __future__ import annotations

import argparse
import math
import re

from reuse_server.api.settings import DEFAULT_SSE_KEEPALIVE
from reuse_server.engine.config import ACTIVATION_DTYPES, ATTENTION_BACKENDS, EngineConfig, cuda_graphs_problem
from reuse_server.engine.watchdog import DEFAULT_STEP_TIMEOUT
from reuse_server.kv.layout import KV_DTYPE_CHOICES
from reuse_server.kv.sizing import AUTO, CPU_CEILING, CPU_FLOOR, CPU_RESERVE, Auto

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "t": 1000**4, "tb": 1000**4}


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '2.5GB', '1073741824' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 1GiB, 512MiB, 2GB or plain bytes")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    return size


def size_or_auto(text: str) -> int | Auto:
    """'auto' (sized at start from the machine: kv/sizing.py) or a size, as parse_size."""
    return AUTO if text.strip().lower() == "auto" else parse_size(text)


def host_tier_size(text: str) -> int | Auto:
    """As size_or_auto, and 0 turns the host tier off."""
    return 0 if re.fullmatch(r"\s*0+\s*[a-zA-Z]*\s*", text) else size_or_auto(text)


def share(text: str) -> float:
    value = _number(text)
    if not 0.0 < value <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"{value} must not be negative" if minimum == 0 else f"{value} must be at least {minimum}")
        return value
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def block_size(text: str) -> int:
    from radix import check_block_size  # the cache index owns the rule

    try:
        return check_block_size(positive_int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1..65535)")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def fraction(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text)
    if not (math.isfinite(value) and value >= 0.0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


def deviation_limit(text: str) -> float | None:
    """A number >= 0, inf (no limit), or auto (None: calibrated for the model)."""
    if text.strip().lower() == "auto":
        return None
    value = _number(text)
    if math.isnan(value) or value < 0.0:
        raise argparse.ArgumentTypeError(f"{text} must be a number >= 0 or inf")
    return value


def positive_float(text: str) -> float:
    value = _number(text)
    if not (math.isfinite(value) and value > 0.0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


DEFAULT_MAX_WAITING = 256


def check_layers(text: str) -> tuple[int, ...]:
    """'1' or '1,4,8': strictly increasing layer indices, each >= 1 (layer 0 has nothing to select on)."""
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer numbers") from None
    if layers[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: check layers start at 1 (layer 0 cannot select tokens)")
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise argparse.ArgumentTypeError(f"{text!r}: check layers must be strictly increasing")
    return layers


def gradual_factors(text: str) -> tuple[float, ...]:
    """'1' or '3,2,1': multipliers of the recompute ratio at each check layer, non-increasing, ending in 1."""
    try:
        factors = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if any(not math.isfinite(f) for f in factors) or any(b > a for a, b in zip(factors, factors[1:])):
        raise argparse.ArgumentTypeError(f"{text!r}: the factors must be finite and non-increasing")
    if factors[-1] != 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: the last factor must be 1 (the ratio itself)")
    return factors


def separator(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("the separator must not be empty")
    return text


def model_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a model name must not be empty")
    return text


def _number_list(values) -> str:
    return ",".join(f"{v:g}" for v in values)


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default, except where there is none to show (None, or an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        if shown and "(default" not in text:
            text += " (default: %(default)s)"
        return text


def add_serve_parser(commands) -> None:
    """The `serve` subcommand and its flags, the one definition of them (cli, cluster's replicas, dynamo-worker)."""
    defaults = EngineConfig()
    serve = commands.add_parser("serve", help="serve a model over HTTP",
                                formatter_class=HelpFormatter,
                                description="Serve a model over an OpenAI-compatible HTTP API.")
    serve.add_argument("--model", default="smollm2",
                       help="a bundled model ('smollm2', or 'gemma3-270m': Gemma 3 270M, under the Gemma Terms of "
                            "Use), a .gguf file, or a Hugging Face checkpoint folder")
    serve.add_argument("--served-model-name", nargs="+", type=model_name, default=None, metavar="NAME",
                       help="the names requests may give as their model, as vLLM's flag: all are accepted and "
                            "listed by /v1/models, the first is the id answers report (e.g. a coding agent's "
                            "own model names after yours). The --model name is accepted too (default: one "
                            "derived from --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port, default=8000, help="TCP port to listen on")
    serve.add_argument("--device", default=defaults.device, help="torch device: cpu, cuda, cuda:1, ...")
    serve.add_argument("--dtype", default=defaults.dtype, choices=["auto", "float32", "float16", "bfloat16"],
                       help="compute dtype, and the weights' with --weight-dtype fp32 and the KV cache's with "
                            "--kv-dtype auto (auto: float32 on CPU, bfloat16 on CUDA)")
    serve.add_argument("--weight-dtype", default=defaults.weight_dtype, choices=["auto", "fp32", "bf16", "int8", "int4"],
                       help="how the weight matrices are held, whatever --dtype computes in: fp32 (as --dtype), bf16, "
                            "int8 or int4 (scale and minimum per group of 32 inputs; the output head in int8); a "
                            "GGUF's Q4/Q8 blocks load as they are, other checkpoints are quantized at load. auto: "
                            "the narrowest whose measured quality against fp32 is within bounds, else the "
                            "narrowest that holds the checkpoint's weights exactly (logged at start)")
    serve.add_argument("--activation-dtype", default=defaults.activation_dtype, choices=ACTIVATION_DTYPES,
                       help="int8: products on int8/int4 weights quantize their inputs to int8 per group of 32 and "
                            "run as integer dot products, as llama.cpp does: faster decode on CPUs with AVX-512 "
                            "VNNI, logits no longer fp32 activations' (BENCHMARKS.md \"Decode\" has both). "
                            "fp32 (default): exact")
    serve.add_argument("--kv-dtype", default=defaults.kv_dtype, choices=KV_DTYPE_CHOICES,
                       help="KV cache storage type, separate from the weights' (auto: the compute dtype). fp16 "
                            "and bf16 halve the pool's bytes per token; fp8_e4m3 (an fp32 scale per block and KV "
                            "head) and int8 (an fp32 scale per token and KV head) store about a quarter, so "
                            "--kv-cache-memory holds that many more tokens; attention dequantizes as it reads")
    serve.add_argument("--cpu-matmul", default=defaults.cpu_matmul, choices=["native", "onednn", "torch"],
                       help="on the CPU, run linear layers on weights packed once at start: through the C++ kernel "
                            "built with the host's compiler (native, float32; oneDNN for bfloat16 or without a "
                            "compiler), through oneDNN (onednn; ~2x faster decode than MKL on AMD CPUs), or "
                            "through torch's F.linear (torch)")
    serve.add_argument("--attention-backend", default=defaults.attention_backend, choices=ATTENTION_BACKENDS,
                       help="native: on the CPU in float32, the paged attention kernel built once with the host's "
                            "C++ compiler, reading K/V in place (torch's attention elsewhere or where it cannot be "
                            "built); torch: torch's scaled_dot_product_attention on gathered K/V; triton: the paged "
                            "Triton kernel reading K/V in place (CUDA; on the CPU only in Triton's interpreter, "
                            "TRITON_INTERPRET=1, slow, for checking); auto: native on the CPU, triton on CUDA")
    serve.add_argument("--cuda-graphs", action="store_true", default=defaults.cuda_graphs,
                       help="capture a CUDA graph of the decode step per batch-size bucket (1, 2, 4, 8, then "
                            "every 16 up to --max-num-seqs) at start and replay it for decode-only steps; "
                            "prefill, mixed steps and blending run eagerly. CUDA with the Triton attention "
                            "only (default: off)")
    serve.add_argument("--cpu-attention", dest="attention_backend", choices=["native", "torch"],
                       help="the former name of --attention-backend's native and torch (default: auto)")
    serve.add_argument("--block-size", type=block_size, default=defaults.block_size,
                       help="tokens per KV cache block (a power of two, 1..512)")
    serve.add_argument("--num-gpu-blocks", type=positive_int, default=None,
                       help="exact number of KV blocks in the pool; overrides --kv-cache-memory (default: sized by it)")
    serve.add_argument("--kv-cache-memory", type=size_or_auto, default=AUTO,
                       help="memory for the KV pool: e.g. 8GiB, 512MiB, plain bytes, or auto: on the CPU "
                            "--kv-cache-share of the RAM available at start (cgroup limits respected) less a "
                            f"{CPU_RESERVE >> 30} GiB reserve, at least {CPU_FLOOR >> 20} MiB and at most "
                            f"{CPU_CEILING >> 30} GiB; on CUDA what --gpu-memory-utilization of the card leaves "
                            "after the weights and a step's activations. Logged at start and shown in "
                            "/v1/cache/stats (sizing)")
    serve.add_argument("--kv-cache-share", type=share, default=defaults.kv_cache_share, metavar="F",
                       help="--kv-cache-memory auto on the CPU: the share of the memory available at start (less "
                            "the reserve) the KV cache takes; the rest is the machine's")
    serve.add_argument("--gpu-memory-utilization", type=share, default=defaults.gpu_memory_utilization,
                       metavar="F", help="--kv-cache-memory auto on CUDA, as vLLM's flag: the share of the card's "
                                         "memory this server may use (weights, activations and the KV pool)")
    serve.add_argument("--window-kv-share", type=float, default=defaults.window_kv_share,
                       help="hybrid models (Gemma 3): keep the sliding-window layers' KV in a pool of its own, with "
                            "room for this share of the blocks (only the last window of each sequence, and cached "
                            "windows, need it); 0 keeps every layer of every block in one pool (default: "
                            f"{defaults.window_kv_share})")
    serve.add_argument("--num-window-blocks", type=positive_int, default=None,
                       help="hybrid models: exact number of blocks in the window layers' pool (overrides the share)")
    serve.add_argument("--max-num-seqs", type=positive_int, default=defaults.max_num_seqs,
                       help="most sequences running at once")
    serve.add_argument("--max-num-batched-tokens", type=positive_int, default=defaults.max_num_batched_tokens,
                       help="token budget of one scheduler step (long prompts are prefilled in chunks)")
    serve.add_argument("--max-model-len", type=positive_int, default=None,
                       help="context length limit (default: the model's maximum)")
    serve.add_argument("--max-tokens", type=positive_int, default=None, metavar="N",
                       help="the most tokens any answer may have, on every route, whatever the request asks (a "
                            "request's smaller limit wins), as llama.cpp's --n-predict: for clients that send no "
                            "limit to a model that may never stop (default: none, the request's limit or the room "
                            "the context leaves)")
    serve.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching, for a baseline (default: prefix caching on)")
    serve.add_argument("--no-prefill-dedup", action="store_true",
                       help="admit a request whose next uncached block another request is computing at once, "
                            "computing it twice, for a baseline (default: it waits one step and hits it)")
    serve.add_argument("--hash", dest="hash_algo", default=defaults.hash_algo, choices=["xxh3_128", "sha256"],
                       help="hash that names KV blocks by their token prefix")
    serve.add_argument("--eviction-policy", default=defaults.eviction_policy, choices=["lru", "lfu"],
                       help="which cached blocks to drop first when the pool is full")
    serve.add_argument("--max-pinned-share", type=float, default=defaults.max_pinned_share, metavar="F",
                       help="the share of the KV pool's blocks one tenant's prompt-cache pins (Anthropic "
                            "cache_control breakpoints) may hold; past it its least recently used pin gives way "
                            f"(default: {defaults.max_pinned_share}; 0 pins nothing)")
    tiers = serve.add_argument_group(
        "KV tiers", "Where blocks go when the device pool evicts them, and where a prompt's missing blocks are "
        "looked for (host RAM, then disk, then Redis). Host RAM: see --cpu-cache-size; disk and Redis: off "
        "unless given.")
    tiers.add_argument("--cpu-cache-size", type=host_tier_size, default=AUTO, metavar="SIZE",
                       help="host RAM for blocks evicted from the device pool, e.g. 4GB, 0 (off), or auto: off on "
                            "the CPU, where it would be a second copy in the same RAM (the pool takes it all), "
                            "and the --kv-cache-memory CPU rule's share of host RAM on CUDA")
    tiers.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                       help="keep blocks in files under DIR, surviving restarts (default: off)")
    tiers.add_argument("--disk-cache-size", type=parse_size, default="10GB", metavar="SIZE",
                       help="disk space for those files; the least recently used go first")
    tiers.add_argument("--disk-write-policy", default=defaults.disk_write_policy, choices=["through", "back"],
                       help="through: every new full block is written to disk; back: only what host RAM evicts")
    tiers.add_argument("--host-write-policy", default=defaults.host_write_policy, choices=["through", "back"],
                       help="through: every new full block is copied to host RAM as it is computed, so the pool "
                            "evicts without copying (a hit that pushes blocks out waits for no copy; host RAM then "
                            "also holds what the pool holds: size it above the pool); back: copied when evicted")
    tiers.add_argument("--tier-fetch", default=defaults.tier_fetch, choices=["auto", "always"],
                       help="auto: read a block from a tier only where that is measured cheaper than recomputing "
                            "it (re-measured now and then); always: read every block a tier holds")
    tiers.add_argument("--redis-url", default=None, metavar="URL",
                       help="share blocks with other servers on the same model through Redis or Valkey, e.g. "
                            "redis://127.0.0.1:6379/0 (run it with --save '' --appendonly no --maxmemory ... "
                            "--maxmemory-policy allkeys-lru) (default: off)")
    tiers.add_argument("--tier-kv-dtype", default=defaults.tier_kv_dtype, choices=KV_DTYPE_CHOICES,
                       help="store the copies in host RAM, on disk and in Redis in this KV dtype, so each byte moved "
                            "carries more tokens (e.g. bf16 or int8 under an fp32 pool; auto: the pool's own). A "
                            "block read back is converted to the pool's dtype: it is what a --kv-dtype of this "
                            "type would have held")
    tiers.add_argument("--redis-timeout", type=non_negative_float, default=defaults.redis_timeout, metavar="SECONDS",
                       help="a Redis call taking longer counts as a miss")
    events = serve.add_argument_group(
        "KV events", "Publish every block stored, moved to a tier or evicted, in vLLM's KV event format, for a "
        "KV-aware router (vllm-router --policy kv_aware --kv-event-source URL=ENDPOINT, Dynamo --router-mode kv). "
        "Tell the router this server's --block-size.")
    events.add_argument("--kv-events", default=None, metavar="tcp://HOST:PORT",
                        help="ZMQ endpoint the events are published on (bound here) (default: off)")
    events.add_argument("--kv-events-replay", default=None, metavar="tcp://HOST:PORT",
                        help="ZMQ endpoint answering a router that missed events (vLLM's replay protocol)")
    blend = serve.add_argument_group(
        "blending", "Non-prefix KV reuse (CacheBlend): chunks of a prompt (chat messages and text parts, "
        "--blend-separator pieces, POST /v1/cache/chunks documents) reuse cached KV wherever they appear; "
        "a share of their tokens is recomputed. A request can override the default with "
        "kv_blend: {\"enabled\": ..., \"recompute_ratio\": ...}.")
    switch = blend.add_mutually_exclusive_group()
    switch.add_argument("--blend", dest="enable_blend", action="store_true", default=defaults.enable_blend,
                        help="blend requests that do not say otherwise (default: off)")
    switch.add_argument("--no-blend", dest="enable_blend", action="store_false",
                        default=defaults.enable_blend, help="blend only requests that ask for it (the default)")
    blend.add_argument("--blend-recompute-ratio", type=fraction, metavar="RATIO",
                       default=defaults.blend_recompute_ratio, help="share of the reused tokens recomputed, 0..1")
    blend.add_argument("--blend-check-layers", type=check_layers, metavar="LAYERS",
                       default=_number_list(defaults.blend_check_layers),
                       help="comma-separated layers (>= 1, increasing) where reused tokens are re-selected")
    blend.add_argument("--blend-gradual-factors", type=gradual_factors, metavar="FACTORS",
                       default=_number_list(defaults.blend_gradual_factors),
                       help="one multiplier of the recompute ratio per check layer, non-increasing, ending in 1 "
                            "(e.g. 3,2,1: three times the ratio kept at the first check layer)")
    blend.add_argument("--blend-score", default=defaults.blend_score, choices=["k", "v", "kv"],
                       help="deviation between reused and fresh KV that picks the tokens to recompute")
    blend.add_argument("--blend-selection", default=defaults.blend_selection, choices=["cacheblend", "epic", "a3"],
                       help="which reused tokens are recomputed: cacheblend (those whose KV deviates most at the "
                            "check layers; every reused token is computed up to there), epic (only the first "
                            "tokens of each reused chunk, at every layer), a3 (those the question attends to most, "
                            "found by one pass of the question over the reused KV). Each spends the recompute "
                            f"ratio (default: {defaults.blend_selection})")
    blend.add_argument("--blend-first-tokens", type=non_negative_int, metavar="N",
                       default=defaults.blend_first_tokens,
                       help="with --blend-selection epic: recompute exactly each reused chunk's first N tokens, "
                            "EPIC's k (0, the default: the recompute ratio's share, spread evenly over the chunks)")
    blend.add_argument("--blend-query-weight", type=non_negative_float, metavar="W",
                       default=defaults.blend_query_weight,
                       help="with --blend-selection cacheblend: first run the prompt's tail after the last reused "
                            "chunk (the question) over the reused KV, and add W times the attention it pays each "
                            "token to the deviation score (0: off, plain CacheBlend; costs one pass of the tail)")
    blend.add_argument("--blend-key-shift", action=argparse.BooleanOptionalAction, default=defaults.blend_key_shift,
                       help="add the model's key shift to chunks reused from their alone form (calibrated once per "
                            "model, ~10 s for SmolLM2, kept in $KV_REUSE_KEY_SHIFT_DIR or the model cache folder); "
                            "--no-blend-key-shift: plain CacheBlend (default: on)")
    blend.add_argument("--blend-min-tokens", type=positive_int, metavar="N", default=defaults.blend_min_tokens,
                       help="shortest chunk, in tokens, that is cached and reused")
    blend.add_argument("--blend-max-deviation", type=deviation_limit, metavar="D",
                       default=defaults.blend_max_deviation,
                       help="the fidelity check: a reused chunk whose K or V at the first check layer deviates "
                            "from what this prompt computes by more than D (relative L2 over the chunk's tokens) "
                            "is rejected and recomputed whole, on top of the recompute ratio; every selection goes "
                            "through it (epic and a3 then compute every reused token up to that layer). auto (the "
                            "default): 1.5 times the largest deviation real paragraphs moved into a chat show on "
                            "this model, calibrated once per model and kept beside the key shift; inf: off; 0: "
                            "reject every chunk")
    blend.add_argument("--blend-chunk-tokens", type=non_negative_int, metavar="N", default=defaults.blend_chunk_tokens,
                       help="cut messages and parts at their blank lines, then into chunks of about N tokens where "
                            "their content says (a "
                            "rolling hash over token windows: the same text cuts the same way wherever it stands), "
                            "so passages glued into one message are found and reused; chunks are never shorter "
                            "than --blend-min-tokens. 0: only the client's messages, parts and separators "
                            "(default: %(default)s)")
    blend.add_argument("--blend-separator", type=separator, metavar="STRING", default=defaults.blend_separator,
                       help="/v1/completions: split a text prompt into reusable chunks at this string, "
                            "which is removed (default: none; the prompt is one piece)")
    service = serve.add_argument_group("service", "Keys, load limits and shutdown.")
    service.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY",
                         help="a key clients must send as 'Authorization: Bearer KEY' on /v1 routes (repeatable; "
                              "visible in the process list, --api-key-file is not); each key is its own cache "
                              "namespace (tenant) (default: none, the routes are open)")
    service.add_argument("--api-key-file", metavar="FILE",
                         help="read more keys from FILE, one a line ('#' lines and blank lines skipped)")
    service.add_argument("--admin-api-key", dest="admin_api_keys", action="append", metavar="KEY",
                         help="a key /metrics requires (repeatable), and the one that sees every tenant's pins in "
                              "/v1/cache/stats (a tenant key sees its own) (default: none, /metrics is open)")
    service.add_argument("--max-waiting", type=positive_int, default=DEFAULT_MAX_WAITING, metavar="N",
                         help="most requests waiting to be scheduled (each choice of n counts); past it, "
                              "429 with Retry-After")
    service.add_argument("--request-timeout", type=positive_float, default=None, metavar="SECONDS",
                         help="abort a request this long after it arrived and answer 408 (a stream ends with "
                              "an error event) (default: none, no limit)")
    service.add_argument("--sse-keepalive", type=non_negative_float, default=DEFAULT_SSE_KEEPALIVE, metavar="SECONDS",
                         help="a stream silent this long (a long prompt being computed) sends a keepalive: "
                              "Anthropic's ping event on /v1/messages, an SSE comment on OpenAI's streams "
                              "(0: none)")
    service.add_argument("--response-store-count", type=int, default=10_000, metavar="N",
                         help="POST /v1/responses with store: keep at most this many responses in memory "
                              "(the oldest go first)")
    service.add_argument("--response-store-size", type=parse_size, default="256MiB", metavar="SIZE",
                         help="... and at most this many bytes of them (token ids included)")
    service.add_argument("--response-store-ttl", type=positive_float, default=24 * 3600.0, metavar="SECONDS",
                         help="with --redis-url, stored responses are also kept in Redis for this long, so the "
                              "next turn (previous_response_id) can be served by any replica sharing it")
    service.add_argument("--step-timeout", type=non_negative_float, default=DEFAULT_STEP_TIMEOUT, metavar="SECONDS",
                         help="an engine that makes no progress for this long with work queued (a step that does "
                              "not return) is stalled: /health and new requests answer 503 with Retry-After, "
                              "requests in flight end with an error, until a step returns (0: no watchdog)")
    service.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0, metavar="SECONDS",
                         help="on SIGTERM, refuse new requests (503) and let those in flight finish for this long, "
                              "then abort the rest and exit 0")
    serve.set_defaults(command_parser=serve)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="log verbosity")


def command_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """`reuse-server` with no subcommand yet, and the place to add them."""
    parser = argparse.ArgumentParser(prog="reuse-server",
                                     description="OpenAI-compatible LLM server that reuses KV cache across requests.")
    return parser, parser.add_subparsers(dest="command", required=True, metavar="COMMAND")


def parse_serve_flags(serve_args: list[str]) -> argparse.Namespace:
    """`reuse-server serve`'s flags read from serve_args (bad flags: argparse prints usage and exits 2)."""
    parser, commands = command_parser()
    add_serve_parser(commands)
    return parser.parse_args(["serve", *serve_args])


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, served_model_name=args.served_model_name, device=args.device, dtype=args.dtype,
        weight_dtype=args.weight_dtype, activation_dtype=args.activation_dtype, kv_dtype=args.kv_dtype,
        cpu_matmul=args.cpu_matmul, attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory=args.kv_cache_memory, kv_cache_share=args.kv_cache_share,
        gpu_memory_utilization=args.gpu_memory_utilization, window_kv_share=args.window_kv_share or None,
        num_window_blocks=args.num_window_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, max_tokens=args.max_tokens, enable_prefix_cache=not args.no_prefix_cache,
        dedup_prefill=not args.no_prefill_dedup,
        hash_algo=args.hash_algo, eviction_policy=args.eviction_policy, max_pinned_share=args.max_pinned_share,
        cpu_cache_size=args.cpu_cache_size, disk_cache_dir=args.disk_cache_dir, disk_cache_size=args.disk_cache_size,
        disk_write_policy=args.disk_write_policy, host_write_policy=args.host_write_policy,
        tier_fetch=args.tier_fetch, redis_url=args.redis_url, redis_timeout=args.redis_timeout,
        tier_kv_dtype=args.tier_kv_dtype, kv_events=args.kv_events, kv_events_replay=args.kv_events_replay,
        enable_blend=args.enable_blend, blend_recompute_ratio=args.blend_recompute_ratio,
        blend_check_layers=args.blend_check_layers, blend_gradual_factors=args.blend_gradual_factors,
        blend_score=args.blend_score, blend_selection=args.blend_selection, blend_first_tokens=args.blend_first_tokens,
        blend_query_weight=args.blend_query_weight, blend_key_shift=args.blend_key_shift,
        blend_min_tokens=args.blend_min_tokens, blend_chunk_tokens=args.blend_chunk_tokens,
        blend_max_deviation=args.blend_max_deviation,
        blend_separator=args.blend_separator)
