"""`reuse-server serve`: flags -> EngineConfig -> AsyncEngine -> FastAPI app -> uvicorn."""
from __future__ import annotations

import argparse
import logging
import re
import sys

from reuse_server.config import EngineConfig

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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def block_size(text: str) -> int:
    value = positive_int(text)
    if value > 512 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"{value} is not a power of two between 1 and 512")
    return value


def port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1..65535)")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default, except where there is none to show (None, or an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        if shown and "(default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    defaults = EngineConfig()
    parser = argparse.ArgumentParser(prog="reuse-server",
                                     description="OpenAI-compatible LLM server that reuses KV cache across requests.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="serve a model over HTTP",
                                formatter_class=_HelpFormatter,
                                description="Serve a model over an OpenAI-compatible HTTP API.")
    serve.add_argument("--model", default="smollm2",
                       help="the bundled model name 'smollm2', a .gguf file, or a Hugging Face checkpoint folder")
    serve.add_argument("--served-model-name", default=None,
                       help="model id shown in /v1/models and required in requests (default: derived from --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port, default=8000, help="TCP port to listen on")
    serve.add_argument("--device", default=defaults.device, help="torch device: cpu, cuda, cuda:1, ...")
    serve.add_argument("--dtype", default=defaults.dtype, choices=["auto", "float32", "float16", "bfloat16"],
                       help="weight and KV cache dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    serve.add_argument("--block-size", type=block_size, default=defaults.block_size,
                       help="tokens per KV cache block (a power of two, 1..512)")
    serve.add_argument("--num-gpu-blocks", type=positive_int, default=None,
                       help="exact number of KV blocks in the pool; overrides --kv-cache-memory (default: sized by it)")
    serve.add_argument("--kv-cache-memory", type=parse_size, default="1GiB",
                       help="memory for the KV pool: e.g. 1GiB, 512MiB, or plain bytes (default: 1GiB)")
    serve.add_argument("--max-num-seqs", type=positive_int, default=defaults.max_num_seqs,
                       help="most sequences running at once")
    serve.add_argument("--max-num-batched-tokens", type=positive_int, default=defaults.max_num_batched_tokens,
                       help="token budget of one scheduler step (long prompts are prefilled in chunks)")
    serve.add_argument("--max-model-len", type=positive_int, default=None,
                       help="context length limit (default: the model's maximum)")
    serve.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching, for a baseline (default: prefix caching on)")
    serve.add_argument("--hash", dest="hash_algo", default=defaults.hash_algo, choices=["xxh3_128", "sha256"],
                       help="hash that names KV blocks by their token prefix")
    serve.add_argument("--eviction-policy", default=defaults.eviction_policy, choices=["lru", "lfu"],
                       help="which cached blocks to drop first when the pool is full")
    serve.add_argument("--seed", type=int, default=defaults.seed, help="seed for hashing and sampling")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="log verbosity")
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, served_model_name=args.served_model_name, device=args.device, dtype=args.dtype,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks, kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_cache=not args.no_prefix_cache,
        hash_algo=args.hash_algo, eviction_policy=args.eviction_policy, seed=args.seed)


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn  # the heavy imports wait until the flags are known to be good

    from reuse_server.api.app import create_app
    from reuse_server.async_engine import AsyncEngine

    try:
        engine = AsyncEngine.from_config(engine_config(args))
    except Exception as exc:  # any load failure is reported as one line; --log-level debug shows the traceback
        logging.getLogger("reuse_server").debug("model load failed", exc_info=True)
        print(f"reuse-server: error: could not load the model: {exc}", file=sys.stderr)
        return 1
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # bad flags: argparse prints usage and a message, exits 2
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
