"""The Triton attention's tests in Triton's interpreter, on a machine without a GPU: the interpreter must be
switched on (TRITON_INTERPRET=1) before triton is imported, which this test process has long done, so they
run in one pytest process of their own with it set. Everything there must pass: a skip would mean a check
that did not run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FILES = ["tests/model/test_attention_triton.py", "tests/model/test_kv_kernels_triton.py",
         "tests/engine/test_engine_triton.py"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU those tests run on it, in this process")
def test_triton_attention_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "-W", "ignore::RuntimeWarning", *FILES],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.fullmatch(r"=*\s*\d+ passed in .*", summary), proc.stdout[-3000:]  # none skipped, none failed
