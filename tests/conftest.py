import os

import pytest
import torch

from tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="session", autouse=True)
def key_shift_dir(tmp_path_factory):
    """Key shifts calibrated for the session's throw-away checkpoints stay in a temporary folder (server
    subprocesses inherit it), not in the user's cache. A folder the caller set is kept."""
    if "KV_REUSE_KEY_SHIFT_DIR" in os.environ:
        yield os.environ["KV_REUSE_KEY_SHIFT_DIR"]
        return
    os.environ["KV_REUSE_KEY_SHIFT_DIR"] = str(tmp_path_factory.mktemp("key-shift"))
    yield os.environ["KV_REUSE_KEY_SHIFT_DIR"]
    del os.environ["KV_REUSE_KEY_SHIFT_DIR"]


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    """A 2-layer random Llama (GQA 4/2 heads, untied) with a tiny BPE tokenizer and a ChatML template."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory):
    """A 2-layer random Qwen2 (q/k/v biases, GQA) with the same tokenizer."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=1)


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda need a CUDA device: skipped without one (`make gpu-check` runs them on a lent GPU)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (make gpu-check runs these on a lent GPU)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
