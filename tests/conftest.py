import pytest

from tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    """A 2-layer random Llama (GQA 4/2 heads, untied) with a tiny BPE tokenizer and a ChatML template."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory):
    """A 2-layer random Qwen2 (q/k/v biases, GQA) with the same tokenizer."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=1)
