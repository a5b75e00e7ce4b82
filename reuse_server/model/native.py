"""The C++ CPU kernels (cpu_attention.cpp, cpu_linear.cpp, cpu_ops.cpp, cpu_quant.cpp, cpu_quant_a8.cpp,
cpu_kv_store.cpp, and cpu_decode.cpp, which runs a decode step's layers through the others): built once into one
shared library, loaded with ctypes.

They are compiled at first use with the host's C++ compiler for the host's instruction set (`-march=native`:
gcc's vector extensions become AVX-512, AVX2 or SSE code), into the cache folder next to the converted
weights, keyed by the sources, the compiler and the CPU; a few seconds, once. OpenMP comes from the libgomp
torch has already loaded (same soname), so the kernels share torch's threads. Without a compiler, the model
keeps torch's and oneDNN's paths (`failure()` says why)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .gguf_convert import default_cache_dir

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_attention.cpp", "cpu_linear.cpp", "cpu_ops.cpp", "cpu_quant.cpp", "cpu_quant_a8.cpp",
                        "cpu_kv_store.cpp", "cpu_decode.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_kernels.h", "cpu_scales.h", "cpu_tasks.h", "cpu_vector.h")]
FLAGS = ["-O3", "-march=native", "-std=c++17", "-fopenmp", "-shared", "-fPIC"]
PREFIX = "cpu_kernels-"

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# The kernels' C signatures (argument types, result type), declared once for every caller.
SIGNATURES = {
    "kv_paged_attention_f32": ([_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I], ctypes.c_int),
    "kv_paged_attention": ([_P, _I, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I], ctypes.c_int),
    "kv_store_fp8": ([_P, _P, _I, _I, _I, _I, _I, _I, _P, _I, _P, _I], None),
    "kv_store_int8": ([_P, _P, _I, _I, _I, _I, _I, _P, _I, _P, _I], None),
    "kv_linear_f32": ([_P, _I, _I, _I, _P, _P, _I, _P, _I], None),
    "kv_rms_norm_f32": ([_P, _I, _I, _I, _P, _F, _P, _I], None),
    "kv_silu_mul_f32": ([_P, _I, _I, _P, _I], None),
    "kv_gelu_mul_f32": ([_P, _I, _I, _P, _I], None),
    "kv_rope_f32": ([_P, _I, _I, _I, _I, _P, _P, _P], ctypes.c_int),
    "kv_argmax_f32": ([_P, _I, _I, _I, _P], None),
    "kv_copy_blocks": ([_P, _I, _P, _P, _I, _I, _I, _I, _I], None),
    "kv_quant_linear_f32": ([_P, _I, _I, _I, _I, _P, _P, _P, _I, _I, _P, _I, _P, _I], ctypes.c_int),
    "kv_quant_rows": ([_I, _P, _P, _P, _I, _I, _I, _P, _I, _P], ctypes.c_int),
    "kv_decode_layers": ([_P, _P, _P, _P, _I, _P, _I], ctypes.c_int),
}



def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (empty where it does not)."""
    line = _cpu_signature()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in [s.read_bytes() for s in SOURCES + HEADERS] + [version.encode(), " ".join(FLAGS).encode(),
                                                     _cpu_signature().encode()]:
        digest.update(part)
    return default_cache_dir() / "kernels" / f"{PREFIX}{digest.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders (test workers, servers) each finish whole
        # Builds of earlier sources or compilers; an hour old, so that a checkout of other sources sharing
        # this folder and building right now does not lose its library before loading it.
        for stale in target.parent.glob(f"{PREFIX}*.so"):
            try:
                if stale != target and time.time() - stale.stat().st_mtime > 3600:
                    stale.unlink()
            except FileNotFoundError:  # another builder removed it first
                pass
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclass(frozen=True)
class NativeLibrary:
    """The kernels' shared library as built for this host, or why it could not be."""

    library: ctypes.CDLL | None
    failure: str | None


@functools.cache
def library() -> NativeLibrary:
    """Built (or found built) and loaded once per process: every model and engine in it shares the result."""
    try:
        compiler = shutil.which(os.environ.get("CXX", "g++"))
        if compiler is None:
            raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
        path = _library_path(compiler)
        if not path.exists():
            log.info("building the CPU kernels with %s (once)", compiler)
            _build(compiler, path)
        loaded = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in SIGNATURES.items():
            fn = getattr(loaded, name)
            fn.argtypes, fn.restype = argtypes, restype
        return NativeLibrary(loaded, None)
    except Exception as exc:  # noqa: BLE001 - any failure means: keep torch's and oneDNN's paths
        failure = f"{type(exc).__name__}: {exc}"
        log.warning("C++ CPU kernels unavailable, using torch's and oneDNN's paths: %s", failure)
        return NativeLibrary(None, failure)


def load() -> ctypes.CDLL | None:
    """The kernels' library; None (and the reason in `failure()`) where it cannot be built."""
    return library().library


def failure() -> str | None:
    return library().failure
