"""The C++ kernels' build: cached by source, compiler and CPU; without a compiler the engine keeps torch's
and oneDNN's paths and says why."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from reuse_server.model import native

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_builds_once_into_the_cache_folder(tmp_path):
    code = """
        from reuse_server.model import native
        assert native.load() is not None, native.failure()
        print(sorted(p.name for p in (native.default_cache_dir() / "kernels").iterdir()))
    """
    first = run_python(code, KV_REUSE_CACHE_DIR=str(tmp_path))
    assert first.returncode == 0, first.stderr
    library = next((tmp_path / "kernels").glob(f"{native.PREFIX}*.so"))
    built_at = library.stat().st_mtime_ns
    second = run_python(code, KV_REUSE_CACHE_DIR=str(tmp_path))
    assert second.returncode == 0, second.stderr
    assert first.stdout == second.stdout and library.stat().st_mtime_ns == built_at  # loaded, not rebuilt


def test_without_a_compiler_the_engine_falls_back(tmp_path, tiny_llama_path):
    result = run_python(f"""
        import torch
        from reuse_server.engine.config import EngineConfig
        from reuse_server.engine.builder import build_engine
        from reuse_server.model import native
        from reuse_server.model.cpu_linear import NativeLinear, PackedLinear
        from reuse_server.engine.sampling_params import SamplingParams
        engine = build_engine(EngineConfig(model={str(tiny_llama_path)!r}, num_gpu_blocks=32))
        assert native.load() is None and "no C++ compiler" in native.failure(), native.failure()
        assert engine.attention_kernel is False
        assert not any(isinstance(m, NativeLinear) for m in engine.model.modules())
        assert any(isinstance(m, PackedLinear) for m in engine.model.modules())
        engine.add_request("r", list(range(3, 20)), SamplingParams(max_tokens=3))
        while engine.has_work():
            engine.step()
        print("served")
    """, KV_REUSE_CACHE_DIR=str(tmp_path), CXX=str(tmp_path / "no-such-compiler"))
    assert result.returncode == 0, result.stderr
    assert "served" in result.stdout
    assert "C++ CPU kernels unavailable" in result.stderr  # the log says why
