"""benchmarks/gpu_check.py (`make gpu-check`) without a GPU: its --dry-run runs every section on the CPU at tiny
shapes with only the packages the lent machine has (the rest made unimportable), so the script cannot rot
before a GPU is lent; without --dry-run it says no CUDA device is present and fails."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# what the lent machine's image lacks (/work/.library/device/KINDS.md's package list) that this project uses
ABSENT_THERE = ["fastapi", "starlette", "uvicorn", "pydantic", "xgrammar", "gguf", "zmq", "redis", "openai",
                "anthropic", "sglang_router", "vllm_router", "msgspec", "agents"]
BLOCKER = f"""
import sys, importlib.abc
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {ABSENT_THERE!r}:
            raise ModuleNotFoundError(f'{{name}} is not on the lent GPU machine')
sys.meta_path.insert(0, Absent())
from benchmarks.gpu_check import main
sys.exit(main(sys.argv[1:]))
"""


def _run(*args, timeout=600):
    # Triton's interpreter, as on a GPU machine the kernels themselves: the dry run's kernel section runs them
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", BLOCKER, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_says_so_and_fails(tmp_path):
    done = _run("--out", str(tmp_path / "out.json"), timeout=120)
    assert done.returncode == 2
    assert "no CUDA device is present" in done.stderr
    assert not (tmp_path / "out.json").exists()


def test_dry_run_runs_every_section_on_the_cpu_without_the_http_stack(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = _run("--dry-run", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed_sections"] == []
    assert report["cuda_tests"]["returncode"] in (0, 5)  # the CUDA-marked tests collect (and skip on the CPU)
    assert report["copy"]["device_copy_gb_s"] > 0
    assert report["kernels"]["status"] == "built"
    assert all(row["max_abs_err"] < 1e-3 for row in report["kernels"]["rows"]), report["kernels"]["rows"]
    assert set(report["models"]) == {"llama-3.1-8b", "smollm2-135m", "gemma3-270m"}
    for name, model in report["models"].items():
        grid = {(r["batch"], r["context"]) for r in model["decode"]["rows"]}
        assert grid == {(b, c) for b in (1, 8, 32) for c in (64, 256)}, name
        assert all(r["step_ms"] > 0 and r["bound_ms"] > 0 for r in model["decode"]["rows"])
        graphs = model["decode_graphs"]  # --cuda-graphs on against off: on the CPU the eager rows alone
        assert "error" not in graphs and [r["batch"] for r in graphs["rows"]] == [1, 8], name
        assert all(r["eager_ms"] > 0 for r in graphs["rows"]) and graphs["steps"] == {"static": 2 * (2 + 2 + 1)}
        engine = model["engine"]
        n = engine["prompt_tokens"]
        assert engine["cold_cached_tokens"] == 0
        assert engine["warm_cached_tokens"] == n - 1  # the warm prompt was a prefix hit to its last token
        assert engine["blended_tokens"] > 0  # the reordered chunks were blended, not computed again
        assert engine["cold_ttft_ms"] > 0 and engine["full_prefill_ttft_ms"] > 0
