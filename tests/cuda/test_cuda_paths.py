"""What runs only on CUDA: dense bf16 and torch's int4 products, tier loads through pinned memory on a side
stream, and the engine end to end. Marked cuda: skipped without a device; `make gpu-check` runs them."""
import pytest
import torch
import torch.nn.functional as F

from reuse_server.kv.pool import HostUploads, KVPool
from reuse_server.kv.tiers.reads import PinnedReadBuffer, read_buffer
from reuse_server.model.quant_linear import DenseLinear, QuantizedLinear, TorchInt4Linear, device_linear
from reuse_server.model.gguf_quant import quantize

pytestmark = pytest.mark.cuda
SEED = 45
CUDA = torch.device("cuda")


def _gen():
    print("seed", SEED)
    return torch.Generator().manual_seed(SEED)


def test_bf16_weights_run_as_one_dense_bf16_product():
    w = torch.randn(256, 512, generator=_gen()) * 0.05
    layer = device_linear(quantize(w, "bf16").to(CUDA), None, CUDA, torch.bfloat16)
    assert isinstance(layer, DenseLinear) and layer.weight.is_cuda and layer.weight.dtype == torch.bfloat16
    x = torch.randn(8, 512, generator=_gen()).bfloat16().to(CUDA)
    assert torch.equal(layer(x), F.linear(x, w.bfloat16().to(CUDA)))


def test_int4_runs_torchs_cuda_kernel_within_rounding_of_the_reference():
    q = quantize(torch.randn(256, 512, generator=_gen()) * 0.05, "int4").to(CUDA)
    layer = device_linear(q, None, CUDA, torch.bfloat16)
    assert isinstance(layer, TorchInt4Linear)
    x = torch.randn(4, 512, generator=_gen()).bfloat16().to(CUDA)
    torch.testing.assert_close(layer(x).float(), QuantizedLinear(q)(x.float()), rtol=2e-2, atol=2e-2)


def test_tier_loads_into_a_cuda_pool_go_through_pinned_rows_on_a_side_stream():
    pool = KVPool(2, 8, 16, 2, 64, "bf16", "cuda", read_dtype=torch.bfloat16)
    k = torch.randn(8 * 16, 2, 64, generator=_gen()).to(CUDA)
    v = torch.randn(8 * 16, 2, 64, generator=_gen()).to(CUDA)
    for layer in range(2):
        pool.write(layer, torch.arange(8 * 16, device=CUDA), k, v)
    exported = pool.export_blocks([1, 2, 3])
    reads = read_buffer(pool.layout.nbytes, pool.device)
    assert isinstance(reads, PinnedReadBuffer)
    rows = reads.rows(3)
    assert all(r.is_pinned() for r in rows)
    for row, data in zip(rows, exported):
        row.copy_(data)
    pool.import_rows([5, 6, 7], rows)
    assert HostUploads.of(CUDA)._last is not None  # the copy went through the side stream
    again = reads.rows(3)  # waits for that copy before the rows may be written again
    assert HostUploads.of(CUDA)._last is None
    assert torch.equal(pool.export_blocks([5, 6, 7]), exported)
    del again


def test_engine_on_cuda_answers_a_prefix_hit_as_it_answered_the_cold_prompt(tiny_llama_path):
    from reuse_server.engine.builder import build_engine
    from reuse_server.engine.config import EngineConfig
    from reuse_server.engine.sampling_params import SamplingParams

    engine = build_engine(EngineConfig(model=str(tiny_llama_path), device="cuda", kv_cache_memory=64 << 20))
    prompt = torch.randint(3, 300, (100,), generator=_gen()).tolist()
    answers = []
    for i in range(2):
        seq = engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        while engine.has_work():
            engine.step()
        answers.append((seq.output_ids, seq.usage.cached_tokens))
    assert len(answers[0][0]) == 8 and answers[0][0] == answers[1][0]
    assert answers[0][1] == 0 and answers[1][1] >= 96
    engine.close()
