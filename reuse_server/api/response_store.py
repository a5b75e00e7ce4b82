"""Stored responses (`store`, `previous_response_id`): each keeps the response as answered and the exact token
ids of its prompt and its answer, so the next turn's prompt starts with those ids (a prefix hit to the last
token, whatever the chat template would make of the earlier turns if they were rendered again).

Bounded in memory by count and bytes (the oldest go first). With --redis-url every record is also written to
Redis with a TTL, so that the next turn can land on any replica sharing it; a record is read from memory
first, then from Redis. A record belongs to the tenant that made it: the tenant is part of its key and is
checked again when it is read, so another tenant's id is simply not found."""
from __future__ import annotations

import base64
import json
import logging
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("reuse_server.api")

DEFAULT_MAX_COUNT = 10_000
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_TTL_SECONDS = 24 * 3600
REDIS_PREFIX = "kvreuse:response:"


def _ids_to_text(ids: list[int]) -> str:
    return base64.b64encode(array("i", ids).tobytes()).decode()


def _ids_from_text(text: str) -> list[int]:
    values = array("i")
    values.frombytes(base64.b64decode(text))
    return values.tolist()


@dataclass
class StoredResponse:
    id: str
    tenant: str | None
    response: dict[str, Any]  # as GET /v1/responses/{id} returns it
    prompt_ids: list[int]
    answer_ids: list[int]
    messages: list[dict]  # the conversation through this answer (chat messages), to re-render it when needed
    framing: str  # what decides the prompt's head besides the messages (instructions, tools)
    chunk_spans: list[tuple[int, int]] = field(default_factory=list)

    def encode(self) -> bytes:
        return json.dumps({"id": self.id, "tenant": self.tenant, "response": self.response,
                           "prompt_ids": _ids_to_text(self.prompt_ids), "answer_ids": _ids_to_text(self.answer_ids),
                           "messages": self.messages, "framing": self.framing,
                           "chunk_spans": self.chunk_spans}, ensure_ascii=False).encode()

    @classmethod
    def decode(cls, blob: bytes) -> "StoredResponse":
        d = json.loads(blob)
        return cls(d["id"], d["tenant"], d["response"], _ids_from_text(d["prompt_ids"]),
                   _ids_from_text(d["answer_ids"]), d["messages"], d["framing"],
                   [tuple(s) for s in d["chunk_spans"]])


class ResponseStore:
    """Thread-safe; its methods block (Redis), so the routes call them on a worker thread."""

    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES,
                 redis_url: str | None = None, ttl_seconds: int = DEFAULT_TTL_SECONDS,
                 redis_timeout: float = 2.0) -> None:
        self.max_count, self.max_bytes, self.ttl = max_count, max_bytes, ttl_seconds
        self._records: OrderedDict[tuple[str | None, str], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._redis = None
        if redis_url:
            import redis  # only with --redis-url
            self._redis = redis.Redis.from_url(redis_url, socket_timeout=redis_timeout,
                                               socket_connect_timeout=redis_timeout)

    @staticmethod
    def _redis_key(tenant: str | None, response_id: str) -> str:
        return f"{REDIS_PREFIX}{tenant or '-'}:{response_id}"

    def __len__(self) -> int:
        return len(self._records)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, record: StoredResponse) -> None:
        blob = record.encode()
        key = (record.tenant, record.id)
        with self._lock:
            if len(blob) > self.max_bytes:
                logger.warning("response %s (%d bytes) is larger than the store (--response-store-size): "
                               "kept only in Redis, if any", record.id, len(blob))
            else:
                self._drop(key)
                self._records[key] = blob
                self._bytes += len(blob)
                while len(self._records) > self.max_count or self._bytes > self.max_bytes:
                    self._drop(next(iter(self._records)))
        if self._redis is not None:
            try:
                self._redis.set(self._redis_key(*key), blob, ex=self.ttl)
            except Exception as exc:  # Redis down: the response stays in this replica's memory
                logger.warning("could not store response %s in Redis: %s", record.id, exc)

    def _drop(self, key) -> None:
        blob = self._records.pop(key, None)
        if blob is not None:
            self._bytes -= len(blob)

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        with self._lock:
            blob = self._records.get((tenant, response_id))
            if blob is not None:
                self._records.move_to_end((tenant, response_id))
        if blob is None and self._redis is not None:
            try:
                blob = self._redis.get(self._redis_key(tenant, response_id))
            except Exception as exc:
                logger.warning("could not read response %s from Redis: %s", response_id, exc)
        if blob is None:
            return None
        record = StoredResponse.decode(blob)
        return record if record.tenant == tenant and record.id == response_id else None

    def delete(self, tenant: str | None, response_id: str) -> bool:
        with self._lock:
            found = (tenant, response_id) in self._records
            self._drop((tenant, response_id))
        if self._redis is not None:
            try:
                found = bool(self._redis.delete(self._redis_key(tenant, response_id))) or found
            except Exception as exc:
                logger.warning("could not delete response %s from Redis: %s", response_id, exc)
        return found
