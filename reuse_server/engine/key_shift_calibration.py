"""Estimate the model's key shift (blend/key_shift.py) once and keep it on disk.

Calibration renders a few RAG-style chats from plain prose (blend/calibration_text.py: one text part per
paragraph, as a RAG client sends passages), computes each one whole, computes each paragraph alone right
after the chat's opening (as a precomputed document is), and averages the difference of the two keys of
every paragraph that had another before it. It runs through the same model layers as serving, over a
scratch KV pool of its own, so it touches neither the serving pool nor the cache accounting. It runs once
per model (seconds on the CPU); later starts load the result.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from blend.calibration_text import PARAGRAPHS
from blend.chunking import chat_opening, encode
from blend.key_shift import KeyShift, KeyShiftEstimate
from safetensors.torch import load_file, save_file

from reuse_server.engine.blender import layer_inv_freq
from reuse_server.kv.pool import KVPool
from reuse_server.model.attention import AttentionMetadata
from reuse_server.model.gguf_convert import default_cache_dir

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 2  # 2: each layer un-rotated with its own RoPE base (version 1's Gemma 3 shifts were wrong)
PASSAGES_PER_CHAT = 4
BLOCK_SIZE = 16


def calibration_chats(tokenizer, paragraphs=PARAGRAPHS) -> tuple[list[int], list[list[list[int]]]]:
    """(opening, chats): the tokens before a chat's first passage, and each chat as its passages' token
    lists. Chat c holds paragraphs c, c+3, c+6, c+9 (mod len), so every paragraph comes first in one chat
    and after others in the rest."""
    n = len(paragraphs)
    orders = [[(c + 3 * j) % n for j in range(PASSAGES_PER_CHAT)] for c in range(n // 2)]
    passages = [list(encode(tokenizer, p)) for p in paragraphs]
    opening = chat_opening(tokenizer)  # what POST /v1/cache/chunks computes a document after
    return opening, [[passages[i] for i in order] for order in orders]


def fitted(opening: list[int], chats: list[list[list[int]]], max_positions: int) -> list[list[list[int]]]:
    """Each chat cut to the model's context: trailing passages dropped (never below two) until it fits, so a
    model with a short context calibrates on shorter chats."""
    out = []
    for passages in chats:
        while len(passages) > 2 and len(opening) + sum(map(len, passages)) > max_positions:
            passages = passages[:-1]
        out.append(passages)
    return out


def scratch_prefill(model, ids: list[int], dtype: torch.dtype, device) -> KVPool:
    """A scratch KV pool holding a prompt computed whole from position 0, at slot == position."""
    n = len(ids)
    cfg = model.config
    blocks = -(-n // BLOCK_SIZE)
    pool = KVPool(cfg.num_layers, blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    positions = torch.arange(n, device=device)
    meta = AttentionMetadata([0, n], [torch.arange(blocks, device=device)], [n], positions)
    model(torch.tensor(ids, device=device), positions, meta, pool)
    return pool


def _keys(model, ids: list[int], dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Every layer's post-RoPE keys [n, kv_heads, head_dim] of a prompt computed whole from position 0."""
    pool = scratch_prefill(model, ids, dtype, device)
    return [k.float() for k in pool.read_keys(torch.arange(len(ids), device=device))]


@torch.inference_mode()
def calibrate(model, tokenizer, dtype: torch.dtype, device, paragraphs=PARAGRAPHS) -> KeyShift:
    cfg = model.config
    opening, chats = calibration_chats(tokenizer, paragraphs)
    estimate = KeyShiftEstimate(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, layer_inv_freq(model))
    alone_cache: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for passages in fitted(opening, chats, cfg.max_position_embeddings):
        whole = _keys(model, opening + [t for p in passages for t in p], dtype, device)
        start = len(opening) + len(passages[0])
        for p in passages[1:]:
            key = tuple(p)
            if key not in alone_cache:
                alone_cache[key] = [k[len(opening):] for k in _keys(model, opening + p, dtype, device)]
            n = len(p)
            estimate.add([k[start:start + n] for k in whole], torch.arange(start, start + n),
                         alone_cache[key], torch.arange(len(opening), len(opening) + n))
            start += n
    return estimate.result()


def default_shift_dir() -> Path:
    env = os.environ.get("KV_REUSE_KEY_SHIFT_DIR")
    return Path(env).expanduser() if env else default_cache_dir() / "key-shift"


def cache_path(model_path: Path, tokenizer, dtype: torch.dtype, cache_dir: Path | None = None) -> Path:
    """Where the shift of this model (weights, dtype, chat opening, calibration text) is kept:
    $KV_REUSE_KEY_SHIFT_DIR, else key-shift/ in the model cache folder."""
    opening, chats = calibration_chats(tokenizer)
    weights = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(model_path).glob("*.safetensors"))
    ident = json.dumps([CALIBRATION_VERSION, str(Path(model_path).resolve()), weights, str(dtype), opening, chats])
    digest = hashlib.sha256(ident.encode()).hexdigest()[:24]
    return Path(cache_dir or default_shift_dir()) / f"{digest}.safetensors"


def load_or_calibrate(model, tokenizer, model_path: Path, dtype: torch.dtype, device,
                      cache_dir: Path | None = None) -> KeyShift:
    path = cache_path(model_path, tokenizer, dtype, cache_dir)
    if path.exists():
        try:
            return KeyShift.from_dict(load_file(str(path)))
        except Exception as exc:  # a damaged file is recomputed, not fatal
            log.warning("ignoring unreadable key-shift file %s: %s", path, exc)
    log.info("calibrating the key shift for blending (once per model)")
    shift = calibrate(model, tokenizer, dtype, device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
        os.close(fd)
        save_file(shift.to_dict(), tmp)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not keep the key shift in %s: %s", path, exc)
    return shift
