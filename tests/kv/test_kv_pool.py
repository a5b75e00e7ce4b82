import pytest
import torch

from pools import fill_pool
from reuse_server.kv.pool import KVPool


def make_pool(num_blocks=6, block_size=4, dtype=torch.float32):
    return KVPool(num_layers=2, num_blocks=num_blocks, block_size=block_size, num_kv_heads=2, head_dim=3, dtype=dtype, device="cpu")


def fill(pool, seed=0):
    fill_pool(pool, torch.Generator().manual_seed(seed))


def test_shapes_and_allocation_once():
    pool = make_pool()
    k, v = pool.layer_blocks(1)
    assert k.shape == v.shape == (6, 4, 2, 3) and k.is_contiguous() and v.is_contiguous()
    ptr = k.data_ptr()
    pool.write(1, torch.tensor([5]), torch.ones(1, 2, 3), torch.ones(1, 2, 3))
    assert pool.layer_blocks(1)[0].data_ptr() == ptr
    assert pool.nbytes == 2 * 2 * 6 * 4 * 2 * 3 * 4


def test_export_then_import_reproduces_every_layer_of_a_block():
    pool = make_pool()
    fill(pool)
    data = pool.export_blocks([4, 1])
    assert data.shape == (2, pool.layout.nbytes) and data.is_contiguous() and data.dtype == torch.uint8
    assert pool.layout.nbytes == 2 * 2 * 4 * 2 * 3 * 4
    slots = lambda block: torch.arange(block * 4, block * 4 + 4)
    before = [pool.read(layer, slots(4)) for layer in range(2)]
    other = make_pool()
    other.import_blocks([0, 3], data)
    for layer in range(2):
        k, v = other.read(layer, slots(0))
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
        assert torch.equal(other.read(layer, slots(3))[0], pool.read(layer, slots(1))[0])
    assert not other.read(0, slots(1))[0].any()  # nothing else written
    with pytest.raises(ValueError, match=r"expected uint8 \[1, "):
        other.import_blocks([2], data)


def test_gather_follows_block_table_order():
    pool = make_pool()
    block_table = torch.tensor([4, 1, 3])  # positions 0-3 in block 4, 4-7 in block 1, 8-11 in block 3
    length = 10
    k = torch.randn(length, 2, 3)
    v = torch.randn(length, 2, 3)
    slots = torch.tensor([int(block_table[p // 4]) * 4 + p % 4 for p in range(length)])
    pool.write(0, slots, k, v)
    gk, gv = pool.gather(0, block_table, length)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    other_k, _ = pool.gather(1, block_table, length)  # layers are separate
    assert not other_k.any()
    rk, rv = pool.read(0, slots[[7, 2]])
    assert torch.equal(rk, k[[7, 2]]) and torch.equal(rv, v[[7, 2]])


def test_gather_needs_enough_blocks():
    pool = make_pool()
    with pytest.raises(ValueError, match="blocks"):
        pool.gather(0, torch.tensor([0, 1]), 9)


def test_write_casts_to_pool_dtype():
    pool = make_pool(dtype=torch.bfloat16)
    pool.write(0, torch.tensor([0, 9]), torch.full((2, 2, 3), 1.5), torch.full((2, 2, 3), -2.0))
    k, v = pool.read(0, torch.tensor([9]))
    assert k.dtype == torch.bfloat16 and k.float().eq(1.5).all() and v.float().eq(-2.0).all()


def test_bytes_per_block_and_from_memory():
    per_block = KVPool.bytes_per_block(num_layers=2, block_size=4, num_kv_heads=2, head_dim=3, dtype=torch.float16)
    assert per_block == 2 * 2 * 4 * 2 * 3 * 2
    pool = KVPool.from_memory(per_block * 7 + per_block // 2, 2, 4, 2, 3, torch.float16, "cpu")
    assert pool.num_blocks == 7
    assert pool.nbytes == 7 * per_block
    with pytest.raises(ValueError, match="no KV block"):
        KVPool.from_memory(per_block - 1, 2, 4, 2, 3, torch.float16, "cpu")


def test_copy_blocks_copies_every_layer():
    pool = make_pool()
    fill(pool)
    pool.copy_blocks([2, 0], [5, 3])
    for layer in range(2):
        k, v = pool.layer_blocks(layer)
        assert torch.equal(k[5], k[2]) and torch.equal(v[3], v[0]) and not torch.equal(k[5], k[0])


def test_copy_slots_copies_every_layer():
    pool = make_pool()
    fill(pool)
    pool.copy_slots(torch.tensor([1, 9]), torch.tensor([20, 4]))
    for layer in range(2):
        assert torch.equal(pool.read(layer, torch.tensor([20, 4]))[1], pool.read(layer, torch.tensor([1, 9]))[1])


def test_consecutive_blocks_are_read_in_place():
    pool = make_pool(num_blocks=8)
    table = torch.tensor([2, 3, 4, 6])
    k, v = torch.randn(14, 2, 3), torch.randn(14, 2, 3)
    slots = torch.tensor([int(table[p // 4]) * 4 + p % 4 for p in range(14)])
    pool.write(1, slots, k, v)
    assert pool.consecutive_start(table, 12) == 2  # positions 0..11 live in blocks 2, 3, 4
    assert pool.consecutive_start(table, 13) is None  # position 12 is in block 6
    assert pool.consecutive_start(torch.tensor([2, 4, 3]), 12) is None  # right span, wrong order
    gk, gv = pool.gather(1, table, 11, first_block=2)
    assert torch.equal(gk, k[:11]) and torch.equal(gv, v[:11])
    assert gk.data_ptr() == pool.layer_blocks(1)[0][2].data_ptr()  # a view of the pool, not a copy
    copied, _ = pool.gather(1, table, 11)
    assert torch.equal(copied, gk)
    # the consecutive run a table starts with, for attending a warm request's prefix in place
    assert pool.leading_run(table, 14) == (2, 3)
    assert pool.leading_run(table, 5) == (2, 2)  # only the blocks holding positions 0..4 count
    assert pool.leading_run(torch.tensor([5, 2, 3]), 12) == (5, 1)
    assert pool.leading_run(table, 0) == (0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned staging buffer is the CUDA pool's")
def test_cuda_exports_go_through_one_staging_buffer_and_each_keeps_its_bytes():
    torch.manual_seed(7)
    pool = KVPool(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=3, device="cuda")
    original = pool.layout.encode(torch.randn(8, *pool.layout.shape))
    pool.import_blocks(list(range(8)), original)
    first, first_copied = pool.export_blocks_async([0, 1, 2])
    staging = pool._staging._buffer.data_ptr()
    second, second_copied = pool.export_blocks_async([5, 6])  # reuses the staging buffer the first went through
    assert pool._staging._buffer.data_ptr() == staging
    pool.import_blocks([0, 1, 2, 5, 6], pool.layout.encode(torch.randn(5, *pool.layout.shape)))  # ids reused at once
    second_copied.synchronize()
    first_copied.synchronize()
    assert torch.equal(first, original[[0, 1, 2]]) and torch.equal(second, original[[5, 6]])
    assert torch.equal(pool.export_blocks([7]), original[[7]])  # the waiting export reads through it too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_block_copies_equal_torch_s_both_ways(dtype, monkeypatch):
    """Exports and row imports go through the C++ copy on a CPU pool without scales: the same bytes as
    torch's strided copies, into and out of scattered block ids."""
    pool = make_pool(num_blocks=12, dtype=dtype)
    assert pool._native_copy() is not None, "the C++ kernels are built here: the copy must use them"
    fill(pool, seed=3)
    blocks = [9, 2, 3, 4, 0, 11]
    native = pool.export_blocks(blocks)
    monkeypatch.setattr(pool, "_native_copy", lambda: None)
    assert torch.equal(native, pool.export_blocks(blocks))  # torch's path, from the same pool
    monkeypatch.undo()
    targets = [1, 7, 8, 5, 10, 6]
    via_native, via_torch = make_pool(num_blocks=12, dtype=dtype), make_pool(num_blocks=12, dtype=dtype)
    rows = list(native)  # adjacent rows of one buffer
    via_native.import_rows(targets, rows)
    monkeypatch.setattr(via_torch, "_native_copy", lambda: None)
    via_torch.import_rows(targets, rows)
    assert torch.equal(via_native._data, via_torch._data)
    assert torch.equal(via_native.export_blocks(targets), native)
    with pytest.raises(ValueError, match="expected uint8"):
        via_native.import_rows([0], [native[0, :-1]])
    with pytest.raises(ValueError, match="outside"):
        via_native.import_rows([12], [native[0]])
