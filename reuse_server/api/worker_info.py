"""What a load-balancing gateway asks of a worker, answered from the engine's state: GET /server_info and
/model_info (read once when a worker registers: its model name becomes the worker's model id) and GET
/get_load (polled to balance by load).

The shapes are those the SGLang model gateway (`sglang-router`, `smg`) reads from SGLang workers:
/get_load is a list with one entry per data-parallel rank (here one) of `num_reqs` (running and waiting),
`num_waiting_reqs` and `num_tokens`, the tokens the worker is committed to: KV held by requests now plus the
tokens of the requests still waiting. The gateway's power-of-two policy sends a request to the worker with
fewer `num_tokens`. These routes are open like /health: they tell the model, the limits and how busy the
server is, nothing about any request."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from pydantic import BaseModel

from reuse_server.engine.client import EngineClient

try:
    VERSION = version("kv-reuse-server")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "unknown"


class ServerInfo(BaseModel):
    served_model_name: str
    model_path: str
    version: str
    dp_size: int = 1
    max_total_tokens: int  # tokens the KV pool holds
    max_running_requests: int  # --max-num-seqs
    max_prefill_tokens: int  # --max-num-batched-tokens: a step's token budget
    max_model_len: int
    block_size: int
    kv_events: dict | None = None  # where this server publishes its KV events (kv/events.py), None: it does not


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str
    served_model_name: str
    model_type: str  # the Hugging Face model_type (llama, mistral, qwen2)
    is_generation: bool = True


class RankLoad(BaseModel):
    dp_rank: int = 0
    num_reqs: int  # requests in flight: running and waiting
    num_waiting_reqs: int
    num_tokens: int  # KV tokens held by requests + tokens of waiting requests
    kv_blocks_in_use: int
    kv_blocks_total: int


def server_info(engine: EngineClient) -> ServerInfo:
    config = engine.config
    snap = engine.snapshot()
    block_size = snap["memory"]["block_size"]
    return ServerInfo(served_model_name=engine.model_id, model_path=_model_path(config), version=VERSION,
                      max_total_tokens=snap["total_blocks"] * block_size, max_running_requests=config.max_num_seqs,
                      max_prefill_tokens=config.max_num_batched_tokens, max_model_len=engine.max_model_len,
                      block_size=block_size, kv_events=engine.kv_events)


def model_info(engine: EngineClient) -> ModelInfo:
    path = _model_path(engine.config)
    return ModelInfo(model_path=path, tokenizer_path=path, served_model_name=engine.model_id,
                     model_type=engine.model_architecture)


def load(engine: EngineClient) -> list[RankLoad]:
    snap = engine.snapshot()
    waiting = engine.num_waiting
    requests = max(engine.num_requests, waiting)
    held = snap["in_use_blocks"] * snap["memory"]["block_size"]
    return [RankLoad(num_reqs=requests, num_waiting_reqs=waiting, num_tokens=held + engine.num_waiting_tokens,
                     kv_blocks_in_use=snap["in_use_blocks"], kv_blocks_total=snap["total_blocks"])]


def _model_path(config) -> str:
    return config.model or "smollm2"
