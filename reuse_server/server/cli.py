"""`reuse-server serve`: flags -> EngineConfig -> AsyncEngine -> FastAPI app -> uvicorn (draining on SIGTERM)."""
from __future__ import annotations

import argparse
import logging
import sys

from reuse_server.server.openmp import apply_short_spin  # torch-free

apply_short_spin()  # before torch is imported: see reuse_server/server/openmp.py

from reuse_server.engine.config import EngineConfig, cuda_graphs_problem  # noqa: E402  (torch-free)
from reuse_server.kv.layout import KV_DTYPE_CHOICES  # noqa: E402  (torch-free)
from reuse_server.server.args import (HelpFormatter, add_serve_parser, block_size, command_parser,  # noqa: E402
                                      engine_config, parse_size, positive_int)
from reuse_server.server.cluster import add_parser as add_cluster_parser  # noqa: E402  (torch-free)
from reuse_server.server.dynamo_worker import add_parser as add_dynamo_parser  # noqa: E402  (dynamo: only to run)

# How long a thread waiting for the GIL lets the holder run before it asks for it (Python's default: 5 ms).
# The engine thread comes back from each native call needing the GIL, often while the event loop holds it to
# stream the last step's tokens; a short interval bounds that wait. Two servers up at once, 8 alternating
# rounds each: 8 streams 1.4-4.1% faster in three runs (fp32 and int8 activations), one stream unchanged
# within the noise (BENCHMARKS.md, "Decode").
GIL_SWITCH_INTERVAL_S = 0.0002


def build_parser() -> argparse.ArgumentParser:
    parser, commands = command_parser()
    add_serve_parser(commands)
    add_kv_calc_parser(commands)
    add_cluster_parser(commands, HelpFormatter)
    add_dynamo_parser(commands, HelpFormatter)
    return parser


def add_kv_calc_parser(commands) -> None:
    calc = commands.add_parser(
        "kv-calc", help="how much KV cache a model needs and what fits in memory (reads the config only)",
        formatter_class=HelpFormatter,
        description="Size the KV cache from a model's config (no weights are loaded): bytes per token and per "
                    "block, the padding of partly filled last blocks, and what fits in a memory budget.")
    calc.add_argument("--model", default="smollm2",
                      help="a bundled model ('smollm2' or 'gemma3-270m'), a .gguf file, a config.json, or a Hugging "
                           "Face folder")
    calc.add_argument("--kv-dtype", default="auto", choices=KV_DTYPE_CHOICES,
                      help="KV element type (auto: the device's default, fp32 on cpu and bf16 on cuda; fp8_e4m3 "
                           "adds an fp32 scale per block and KV head, int8 one per token and KV head)")
    calc.add_argument("--device", default="cpu", help="device that resolves --kv-dtype auto: cpu, cuda, ...")
    calc.add_argument("--block-size", type=block_size, default=EngineConfig().block_size,
                      help="tokens per KV cache block (a power of two, 1..512)")
    calc.add_argument("--context", type=positive_int, default=None,
                      help="tokens per sequence (default: the model's maximum context)")
    calc.add_argument("--concurrency", type=positive_int, default=1, help="sequences held at once")
    calc.add_argument("--memory", type=parse_size, default="1GiB",
                      help="memory for the KV cache: e.g. 2GB, 512MiB, or plain bytes (default: 1GiB)")
    calc.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    calc.set_defaults(command_parser=calc)


def blend_flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong across the blending flags (each flag is checked alone by its type), or None."""
    if len(args.blend_gradual_factors) != len(args.blend_check_layers):
        return (f"--blend-gradual-factors has {len(args.blend_gradual_factors)} values but --blend-check-layers "
                f"has {len(args.blend_check_layers)} layers; give one factor per check layer")
    if args.blend_first_tokens and args.blend_selection != "epic":
        return (f"--blend-first-tokens is EPIC's count of first tokens per chunk; it needs --blend-selection epic "
                f"(got {args.blend_selection})")
    if args.blend_query_weight and args.blend_selection != "cacheblend":
        return (f"--blend-query-weight weighs the question's attention into CacheBlend's deviation score; it needs "
                f"--blend-selection cacheblend (got {args.blend_selection}; a3 selects by that attention alone)")
    return None


def tenant_keys(args: argparse.Namespace) -> list[str]:
    """--api-key values and the lines of --api-key-file; raises OSError for an unreadable file."""
    from reuse_server.api.api_keys import read_key_file

    return list(args.api_keys or []) + (read_key_file(args.api_key_file) if args.api_key_file else [])


def key_flags_problem(args: argparse.Namespace) -> str | None:
    """A key flag that would leave the server less protected than asked (an empty key, a file without keys)."""
    if any(not key.strip() for key in (args.api_keys or []) + (args.admin_api_keys or [])):
        return "an API key must not be empty"
    if args.api_key_file:
        try:
            from_file = tenant_keys(args)[len(args.api_keys or []):]
        except (OSError, UnicodeDecodeError) as exc:
            return f"could not read --api-key-file: {exc}"
        if not from_file:
            return f"--api-key-file {args.api_key_file} holds no keys"
    return None


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn  # the heavy imports wait until the flags are known to be good

    from reuse_server.api.app import create_app
    from reuse_server.api.settings import ServerSettings
    from reuse_server.engine.async_engine import AsyncEngine
    from reuse_server.server.library_pages import release_library_pages
    from reuse_server.server.metrics import wire_metrics
    from reuse_server.server.serving import DrainingServer

    from reuse_server.api.api_keys import ApiKeys

    keys = ApiKeys(tenant_keys(args), args.admin_api_keys or [])
    try:
        engine = AsyncEngine.launch(engine_config(args), max_waiting=args.max_waiting,
                                    step_timeout=args.step_timeout or None)
    except Exception as exc:  # any load failure is reported as one line; --log-level debug shows the traceback
        logging.getLogger("reuse_server").debug("model load failed", exc_info=True)
        print(f"reuse-server: error: could not load the model: {exc}", file=sys.stderr)
        return 1
    from reuse_server.api.response_store import ResponseStore
    responses = ResponseStore(args.response_store_count, args.response_store_size, args.redis_url,
                              int(args.response_store_ttl), args.redis_timeout or 2.0)
    settings = ServerSettings(api_keys=keys, request_timeout=args.request_timeout, responses=responses,
                              sse_keepalive=args.sse_keepalive or None)
    app = create_app(engine, wire_metrics(engine), settings=settings)
    # ws="none": no route takes a WebSocket, and uvicorn would otherwise import the websockets library
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, ws="none")
    release_library_pages()  # the last start-up work is done: what requests use faults back in
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    DrainingServer(config, engine, args.shutdown_timeout).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # bad flags: argparse prints usage and a message, exits 2
    if args.command == "serve":
        problem = blend_flags_problem(args) or key_flags_problem(args) or (
            cuda_graphs_problem(args.device, args.attention_backend) if args.cuda_graphs else None)
        if problem:
            args.command_parser.error(problem)
        return serve(args)
    if args.command == "kv-calc":
        return kv_calc(args)
    if args.command == "cluster":
        from reuse_server.server.cluster import run as run_cluster

        return run_cluster(args)
    if args.command == "dynamo-worker":
        from reuse_server.server.dynamo_worker import run as run_dynamo_worker

        return run_dynamo_worker(sys.argv[1:] if argv is None else list(argv))
    return 2


def kv_calc(args: argparse.Namespace) -> int:
    from reuse_server.kv.calc import run
    from reuse_server.model.errors import ModelLoadError

    try:
        return run(args)
    except (ModelLoadError, ValueError) as exc:  # a model that cannot be read: one line, exit 2
        args.command_parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
