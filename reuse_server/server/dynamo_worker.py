"""`reuse-server dynamo-worker`: our engine as an NVIDIA Dynamo 1.6.1 token-in/token-out worker, so that
`python -m dynamo.frontend --router-mode kv` in front of N of them routes by our real caches.

Dynamo's frontend does HTTP, the chat template and tokenizing (from the model folder we register: its
tokenizer.json, tokenizer_config.json and config.json) and sends each request to a worker as token ids; the
worker streams back token ids. Ours runs the same engine as `reuse-server serve` (prefix reuse, tiers and Redis
work the same) and publishes its KV events in vLLM's format (kv/events.py) on a loopback ZMQ socket that
Dynamo's worker runtime subscribes to and relays to its routers (`ZmqSource`). Blending cannot be asked for:
a token-level request carries no chunk boundaries (messages, text parts) and no `kv_blend` options.

The worker's Dynamo system server (DYN_SYSTEM_PORT) serves the engine's `kvreuse_*` metrics in its /metrics,
next to Dynamo's own (`register_prometheus`), so a worker's hits and requests are read as a `serve` replica's.

Dynamo comes with `make` (the `dynamo` extra, then `pip install --no-deps ai-dynamo==1.6.1`: its other
dependencies are NVIDIA-only); the server itself never imports it. Run without etcd or NATS with `--discovery-backend file` (DYN_FILE_KV: the
folder workers and frontend share), `--request-plane tcp` and `--event-plane zmq`.

    reuse-server dynamo-worker [--namespace dynamo] [--component backend] -- --model DIR [serve flags]"""
from __future__ import annotations

import argparse
import asyncio
import uuid

from reuse_server.server.args import HelpFormatter, command_parser
from reuse_server.server.launcher import free_port


def add_parser(commands, formatter_class) -> None:
    p = commands.add_parser(
        "dynamo-worker", formatter_class=formatter_class,
        help="serve the engine as an NVIDIA Dynamo worker (token ids in and out, KV events to Dynamo's router)",
        description="Register the engine with Dynamo's runtime as a token-in/token-out worker of the model folder "
                    "given with --model, and relay its KV events to Dynamo's KV router. Flags after `--` are "
                    "those of `reuse-server serve` (its HTTP flags are not used).")
    p.add_argument("--namespace", default="dynamo")
    p.add_argument("--component", default="backend")
    p.add_argument("--endpoint", default="generate")
    p.add_argument("--discovery-backend", default="file", help="file (DYN_FILE_KV), etcd, ...")
    p.add_argument("--request-plane", default="tcp")
    p.add_argument("--event-plane", default="zmq")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="-- SERVE_ARGS")
    p.set_defaults(command_parser=p)


def worker_parser() -> argparse.ArgumentParser:
    """`reuse-server dynamo-worker`'s own flags (those after `--` are serve's: args.parse_serve_flags)."""
    parser, commands = command_parser()
    add_parser(commands, HelpFormatter)
    return parser


def sampling_params(request: dict):
    """Dynamo's sampling_options and stop_conditions as our SamplingParams."""
    from reuse_server.engine.sampling_params import SamplingParams

    options = request.get("sampling_options") or {}
    stop = request.get("stop_conditions") or {}
    params = SamplingParams(max_tokens=stop.get("max_tokens") or 16, ignore_eos=bool(stop.get("ignore_eos")),
                            stop_token_ids=list(stop.get("stop_token_ids_hidden") or []))
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if options.get(name) is not None:
            setattr(params, name, options[name])
    return params


def served_names(config) -> list:
    """--served-model-name as one or several names ([None]: Dynamo names the model after its folder)."""
    names = config.served_model_name
    return [names] if names is None or isinstance(names, str) else list(names)


def engine_class():
    """The Dynamo engine class (built here: dynamo is imported only when the command runs)."""
    from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
    from dynamo.common.backend.metrics import register_engine_registry
    from dynamo.common.backend.publisher import ZmqSource

    from reuse_server.engine.async_engine import AsyncEngine
    from reuse_server.server.args import engine_config, parse_serve_flags
    from reuse_server.server.metrics import wire_metrics

    class ReuseEngine(LLMEngine):
        def __init__(self, config):
            self.config = config
            self.engine: AsyncEngine | None = None

        @classmethod
        async def from_args(cls, argv=None):
            args = worker_parser().parse_args(argv)
            serve_args = list(args.serve_args)
            if serve_args[:1] == ["--"]:
                serve_args = serve_args[1:]
            config = engine_config(parse_serve_flags(serve_args))
            if not config.kv_events:  # Dynamo's runtime subscribes to it on loopback
                config.kv_events = f"tcp://127.0.0.1:{free_port()}"
            if not config.model:
                args.command_parser.error("give the model folder after --: -- --model DIR")
            worker = WorkerConfig(namespace=args.namespace, component=args.component, endpoint=args.endpoint,
                                  model_name=config.model, served_model_name=served_names(config)[0],
                                  discovery_backend=args.discovery_backend, request_plane=args.request_plane,
                                  event_plane=args.event_plane, use_kv_events=True)
            return cls(config), worker

        async def start(self, worker_id: int):
            self.engine = await asyncio.to_thread(AsyncEngine.launch, self.config)
            wire_metrics(self.engine)  # the worker's /metrics carries them (register_prometheus)
            await self.engine.start()
            parts = self.engine.engine
            # as Dynamo's own vLLM worker does: the first served name is the model's, the others its aliases
            first, *aliases = served_names(self.config)
            return EngineConfig(model=self.config.model, served_model_name=first, model_aliases=aliases,
                                llm=LlmRegistration(context_length=parts.max_model_len,
                                                    kv_cache_block_size=self.config.block_size,
                                                    total_kv_blocks=parts.cache.num_blocks,
                                                    max_num_seqs=self.config.max_num_seqs,
                                                    max_num_batched_tokens=self.config.max_num_batched_tokens))

        async def register_prometheus(self, metrics):
            # the worker's Dynamo /metrics (DYN_SYSTEM_PORT) carries the engine's kvreuse_* metrics, as serve's does
            register_engine_registry(metrics, self.engine.metrics.registry, prefix_filters=["kvreuse_"])

        async def kv_event_sources(self):
            return [ZmqSource(endpoint=self.config.kv_events)]

        async def generate(self, request, context):
            prompt = list(request.get("token_ids") or [])
            # checked and its output limit fitted to the context and --max-tokens, as on serve's routes
            params = self.engine.validate_prompt(prompt, sampling_params(request))
            stream = self.engine.generate(f"dyn-{uuid.uuid4().hex}", prompt, params)
            try:
                async for out in stream:
                    if context.is_stopped():
                        yield {"token_ids": [], "index": 0, "finish_reason": "cancelled",
                               "completion_usage": usage(out)}
                        return
                    chunk = {"token_ids": list(out.new_token_ids), "index": 0}
                    if out.finished:
                        await self.engine.settle_shared_writes()  # the next turn finds them on any worker
                        chunk["finish_reason"] = out.finish_reason
                        chunk["completion_usage"] = usage(out)
                    yield chunk
            finally:
                await stream.aclose()

        async def cleanup(self):
            if self.engine is not None:
                await self.engine.shutdown()
                self.engine = None

    return ReuseEngine


def usage(out) -> dict:
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def run(argv: list[str]) -> int:
    from dynamo.common.backend.run import run as run_worker

    run_worker(engine_class(), argv)
    return 0
