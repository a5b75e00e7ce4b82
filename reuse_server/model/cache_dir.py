"""Where the engine keeps what it derives once from a model (converted folders, the assembled bundled GGUF,
compiled kernels): $KV_REUSE_CACHE_DIR, else ~/.cache/kv-reuse-server. Torch-free."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    env = os.environ.get("KV_REUSE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kv-reuse-server"
