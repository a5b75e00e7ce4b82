"""KV tiers below the device pool, in one process on the tiny checkpoint: host RAM, disk across restarts,
Redis between engines (a real redis-server), damaged files, holes, outages and the fetch-or-recompute
decision. Every answer is compared with a cold run: a tier may cost hits, never change an answer."""
from __future__ import annotations

import shutil

import pytest
import torch

from radix import BlockRecord
from redis_server import redis_server
from reuse_server.kv.pool import KVPool
from reuse_server.engine.sampling_params import CacheOptions
from reuse_server.kv.tiers.blob import BadBlob, BlobContext, BlockEntry, decode, encode
from reuse_server.engine import builder
from reuse_server.kv.tiers.disk import DiskTier
from reuse_server.kv.tiers.host import HostTier
from reuse_server.kv.tiers.manager import Found, KVTiers
from tier_runs import BS, make, random_prompt, run, same_answer
from tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

SEED = 20261130


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {seed: write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny{seed}"), arch="llama", seed=seed)
            for seed in (3, 4)}


def prompt(seed: int, n: int = 70) -> list[int]:
    return random_prompt(SEED + seed, n)


@pytest.fixture(scope="module")
def cold(checkpoints):
    """What each test prompt gives with no cache at all."""
    engine = make(checkpoints[3], enable_prefix_cache=False)
    return lambda ids: run(engine, f"cold-{len(ids)}-{ids[0]}-{ids[-1]}", ids)


def evict_everything(engine, seed: int) -> None:
    """Unrelated prompts that need the whole device pool."""
    for i in range(3):
        run(engine, f"filler-{seed}-{i}", prompt(1000 + 10 * seed + i), max_tokens=1)


@pytest.mark.parametrize("policy", ["through", "back"])
def test_blocks_evicted_from_the_device_come_back_from_host_ram(checkpoints, cold, policy):
    engine = make(checkpoints[3], cpu_cache_size=10**7, host_write_policy=policy)
    ids = prompt(1)
    run(engine, "first", ids)
    full = (len(ids) - 1) // BS * BS
    # write-through: copied as computed (prompt and answer blocks); write-back: nothing until evicted
    written = engine.snapshot()["tiers"]["host"]["written"]
    assert written >= full // BS if policy == "through" else written == 0
    evict_everything(engine, 1)
    assert engine.cache.match(ids, b"", record_stats=False).num_tokens == 0  # nothing left on the device
    got = run(engine, "again", ids)
    # the full blocks, and the prompt's last tokens (all but the one computed) from the block holding them
    # with the first answer's tokens
    assert got[2].cached_tokens == len(ids) - 1 and got[2].tier_tokens == {"host": len(ids) - 1}
    same_answer(got, cold(ids))
    host = engine.snapshot()["tiers"]["host"]
    assert host["hits"] == full // BS + 1 and host["read_bytes"] == host["hits"] * engine.pool.layout.nbytes


def test_a_restarted_engine_hits_what_it_wrote_to_disk(checkpoints, cold, tmp_path):
    ids = prompt(2)
    first = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    run(first, "first", ids)
    assert first.close()  # flushes the writer
    restarted = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    got = run(restarted, "again", ids)
    full = (len(ids) - 1) // BS * BS
    assert got[2].cached_tokens == full and got[2].tier_tokens == {"disk": full}
    same_answer(got, cold(ids))
    restarted.close()


def disk_files(tmp_path):
    return sorted(p for p in tmp_path.rglob("*.kv"))


def block_file(tmp_path, engine, ids, index):
    return next(p for p in disk_files(tmp_path) if p.stem == engine.block_hashes(ids)[index].hex())


@pytest.mark.parametrize("damage", ["flipped", "truncated", "other-model", "other-tokens"])
def test_a_damaged_or_foreign_file_is_a_miss_deleted_and_never_served(checkpoints, cold, tmp_path, damage):
    ids = prompt(3)
    writer = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    run(writer, "first", ids)
    writer.close()
    target = block_file(tmp_path, writer, ids, 5)
    data = bytearray(target.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncated":
        target.write_bytes(bytes(data[: len(data) // 3]))
    elif damage == "other-model":  # the same prompt's block from another model, under this block's name
        other_dir = tmp_path / "other"
        other = make(checkpoints[4], disk_cache_dir=str(other_dir))
        run(other, "theirs", ids)
        other.close()
        shutil.copy(block_file(other_dir, other, ids, 5), target)
    else:  # a well-formed block of this model, holding another prompt's tokens, under this block's name
        other_ids = prompt(33)
        run(writer2 := make(checkpoints[3], disk_cache_dir=str(tmp_path)), "other", other_ids)
        writer2.close()
        shutil.copy(block_file(tmp_path, writer2, other_ids, 5), target)
    damaged = target.read_bytes()
    reader = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    got = run(reader, "again", ids)
    same_answer(got, cold(ids))
    full = (len(ids) - 1) // BS * BS
    assert got[2].cached_tokens == full - BS  # only the bad block is recomputed
    assert reader.snapshot()["tiers"]["disk"]["corrupt"] == 1
    reader.close()
    assert target.read_bytes() != damaged  # deleted, then written again from the recomputed block
    again = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    assert run(again, "third", ids)[2].tier_tokens == {"disk": full}
    again.close()


def test_a_block_missing_from_every_tier_is_recomputed_alone(checkpoints, cold, tmp_path, monkeypatch):
    """Its KV depends only on the tokens before it, which are the same: the cached blocks after it are still
    used. Engines that stop at the first miss would recompute the rest of the prompt."""
    ids = prompt(4)
    writer = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    run(writer, "first", ids)
    writer.close()
    block_file(tmp_path, writer, ids, 7).unlink()
    reader = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    computed = []
    real = reader.runner.run
    monkeypatch.setattr(reader.runner, "run", lambda chunks, *a: computed.append(
        [(c.seq.num_computed, c.num_tokens) for c in chunks]) or real(chunks, *a))
    got = run(reader, "again", ids)
    same_answer(got, cold(ids))
    full = (len(ids) - 1) // BS * BS
    assert got[2].cached_tokens == full - BS and got[2].tier_tokens == {"disk": full - BS}
    prefill = [step for step in computed if step[0][1] > 1 or step[0][0] < len(ids) - 1]
    assert prefill[0] == [(7 * BS, BS)]  # only the hole
    assert prefill[1] == [(full, len(ids) - full)]  # then the prompt's last tokens
    reader.close()


def test_a_prompt_leaving_a_host_ram_prompt_inside_a_block_reuses_that_block_s_shared_tokens(checkpoints, cold):
    """As the pool copies a partially shared block, a host hit loads the held block that starts like the
    prompt's next block and computes only from where they part."""
    engine = make(checkpoints[3], cpu_cache_size=10**7)
    ids = prompt(12)
    run(engine, "first", ids)
    evict_everything(engine, 12)
    shared = 16 * BS + 2  # two tokens into block 16
    other = ids[:shared] + prompt(13)[:5]
    assert other[shared] != ids[shared]
    got = run(engine, "other", other)
    assert got[2].cached_tokens == shared and got[2].tier_tokens == {"host": shared}
    same_answer(got, cold(other))


@pytest.mark.parametrize("policy", ["through", "back"])
def test_write_through_to_host_ram_copies_nothing_when_the_pool_evicts(checkpoints, policy):
    """Write-through copies each block to host RAM once, as it is computed: a host hit whose blocks push
    fillers out of the pool copies nothing (the fillers were copied when computed, and the hit's own answer
    repeats the first run's, whose blocks are held); write-back copies the fillers in that step."""
    engine = make(checkpoints[3], cpu_cache_size=10**7, host_write_policy=policy)
    ids = prompt(11)
    run(engine, "first", ids)
    evict_everything(engine, 11)
    before = engine.snapshot()["tiers"]["host"]["written"]
    got = run(engine, "again", ids)
    loaded = got[2].tier_tokens["host"] // BS
    copied = engine.snapshot()["tiers"]["host"]["written"] - before
    assert loaded > 0
    assert copied == 0 if policy == "through" else copied >= loaded


def test_a_prompt_as_long_as_a_step_is_written_through_whole(checkpoints, tmp_path, monkeypatch):
    """A writer's queue takes two steps' blocks whatever its floor: one long prefill is not cut short on disk
    (with the floor alone, most of this prompt's blocks would be dropped)."""
    monkeypatch.setattr(builder, "MIN_WRITE_QUEUE_BYTES", 1)
    engine = make(checkpoints[3], disk_cache_dir=str(tmp_path), max_num_batched_tokens=64, num_gpu_blocks=60)
    ids = prompt(12, 64)
    run(engine, "first", ids, max_tokens=1)
    assert engine.tiers.disk.writer.flush(10)
    disk = engine.snapshot()["tiers"]["disk"]
    assert disk["written"] == len(ids) // BS and disk["dropped_writes"] == 0
    engine.close()


def test_a_block_host_ram_holds_goes_to_disk_from_host_ram_not_from_the_pool(tmp_path):
    """Blocks read from host RAM and filed again are written through to the tiers below from host RAM's copy:
    the pool is not copied out a second time in the hit's step (its ids here already hold other KV, and disk
    still gets what host RAM holds)."""
    torch.manual_seed(SEED)
    pool = KVPool(2, 8, BS, 2, 16)
    shape = pool.layout.shape
    pool.import_blocks(list(range(4)), pool.layout.encode(torch.randn(4, *shape)))
    records = [BlockRecord(bytes([i + 1]) * 16, bytes([i]) * 16, bytes(range(BS * 4)), b"", i) for i in range(4)]
    host = HostTier(10**8)
    KVTiers(pool, host=host).stored(records)
    expected = torch.stack([host.get([r.hash])[r.hash].payload() for r in records])
    pool.import_blocks(list(range(4)), pool.layout.encode(torch.randn(4, *shape)))
    ctx = BlobContext(fingerprint="f" * 64, block_size=BS, hash_algo="xxh3_64", layout=pool.layout.describe(),
                      kv_bytes=pool.layout.nbytes)
    disk = DiskTier(tmp_path, 10**8, ctx)
    KVTiers(pool, host=host, disk=disk).stored(records)
    assert disk.writer.flush(10) and disk.stats.written == 4
    got = disk.get([r.hash for r in records])
    assert torch.equal(torch.stack([got[r.hash].payload() for r in records]), expected)
    disk.close()


def test_write_back_keeps_on_disk_only_what_host_ram_pushes_out(checkpoints, tmp_path):
    engine = make(checkpoints[3], cpu_cache_size=10 * 2048, disk_cache_dir=str(tmp_path), disk_write_policy="back",
                  host_write_policy="back")
    ids = prompt(5)
    run(engine, "first", ids)
    assert engine.tiers.disk.writer.flush(10) and not disk_files(tmp_path)  # nothing written through
    evict_everything(engine, 5)  # device -> host (10 blocks fit) -> disk
    assert engine.tiers.disk.writer.flush(10)
    tiers = engine.snapshot()["tiers"]
    assert tiers["host"]["blocks"] == 10 and tiers["disk"]["written"] > 0
    assert len(disk_files(tmp_path)) == tiers["disk"]["blocks"] == tiers["disk"]["written"]
    engine.close()


def test_two_engines_share_blocks_through_redis(checkpoints, cold):
    ids = prompt(6)
    with redis_server() as server:
        first = make(checkpoints[3], redis_url=server.url)
        run(first, "first", ids)
        assert first.tiers.remote.writer.flush(10)
        second = make(checkpoints[3], redis_url=server.url)
        got = run(second, "second", ids)
        full = (len(ids) - 1) // BS * BS
        assert got[2].cached_tokens == full and got[2].tier_tokens == {"redis": full}
        same_answer(got, cold(ids))
        # another model on the same Redis shares nothing
        other = make(checkpoints[4], redis_url=server.url)
        assert run(other, "other", ids)[2].cached_tokens == 0
        for engine in (first, second, other):
            engine.close()


def test_redis_going_down_costs_hits_never_answers_and_hits_resume(checkpoints, cold):
    with redis_server() as server:
        engine = make(checkpoints[3], redis_url=server.url, redis_timeout=0.2)
        run(engine, "warm", prompt(7))
        server.kill()
        during = prompt(8)
        got = run(engine, "during", during)  # Redis is gone: the request is answered anyway
        same_answer(got, cold(during))
        assert engine.snapshot()["tiers"]["redis"]["errors"] >= 1
        server.start()  # back on the same port
        after = prompt(9)
        engine.tiers.remote._retry_at = 0  # skip the pause before the next attempt
        run(engine, "after", after)
        assert engine.tiers.remote.writer.flush(10)
        reader = make(checkpoints[3], redis_url=server.url)
        assert run(reader, "read", after)[2].tier_tokens == {"redis": (len(after) - 1) // BS * BS}
        engine.close()
        reader.close()


def test_a_fetch_slower_than_recomputing_is_declined_and_counted(checkpoints, cold, tmp_path):
    ids = prompt(10)
    writer = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    run(writer, "first", ids)
    writer.close()
    reader = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    reader.tiers.costs.observe_prefill(1000, 0.001)  # as if prefill were 1M tokens/s
    reader.tiers.costs.observe_read("disk", 1, 1.0)  # and a disk read took a second per block
    got = run(reader, "again", ids)
    same_answer(got, cold(ids))
    assert got[2].cached_tokens == 0
    assert reader.snapshot()["tiers"]["disk"]["declined"] >= (len(ids) - 1) // BS
    reader.close()


def test_prefetch_pulls_a_prompt_up_so_the_request_finds_it_on_the_device(checkpoints, cold, tmp_path):
    ids = prompt(11)
    writer = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    run(writer, "first", ids)
    writer.close()
    engine = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    fetched = engine.prefetch("prefetch", ids, CacheOptions())
    full = (len(ids) - 1) // BS * BS
    assert fetched.cached_tokens == full and fetched.tier_tokens == {"disk": full} and not fetched.new_token_ids
    got = run(engine, "request", ids)
    assert got[2].cached_tokens == full and got[2].tier_tokens == {}  # all resident already
    same_answer(got, cold(ids))
    assert engine.snapshot()["in_use_blocks"] == 0
    engine.close()


def test_blobs_refuse_damage_other_models_and_other_blocks():
    ctx = BlobContext(fingerprint="ab" * 32, block_size=4, hash_algo="xxh3_128",
                      layout={"shape": [2, 2, 4, 1, 2], "dtype": "float32"}, kv_bytes=8)
    entry = BlockEntry(b"h" * 16, b"p" * 16, bytes(range(16)), b"ns", torch.arange(8, dtype=torch.uint8))
    blob = encode(entry, ctx)
    back = decode(blob, ctx, expected_hash=b"h" * 16)
    fields = lambda e: (e.hash, e.parent_hash, e.tokens, e.namespace)
    assert fields(back) == fields(entry) and torch.equal(back.kv, entry.kv)
    bad = {
        "checksum mismatch": blob[:40] + bytes([blob[40] ^ 1]) + blob[41:],
        "truncated": blob[:10],
        "not a KV block": b"XXXX" + blob[4:],
        "another model": encode(entry, BlobContext(**{**ctx.__dict__, "fingerprint": "cd" * 32})),
        "another block size": encode(entry, BlobContext(**{**ctx.__dict__, "block_size": 8})),
    }
    for reason, data in bad.items():
        with pytest.raises(BadBlob, match=reason):
            decode(data, ctx)
    with pytest.raises(BadBlob, match="holds another block"):
        decode(blob, ctx, expected_hash=b"x" * 16)


def test_a_tenant_never_hits_another_tenants_blocks_in_any_tier(checkpoints, tmp_path):
    """The namespace (tenant, cache salt) is folded into every block's identity, so tiers keep tenants apart
    as the device pool does."""
    ids = prompt(12)
    with redis_server() as server:
        writer = make(checkpoints[3], cpu_cache_size=10**7, disk_cache_dir=str(tmp_path), redis_url=server.url)
        run(writer, "alpha", ids, tenant="a" * 32)
        writer.close()
        reader = make(checkpoints[3], cpu_cache_size=10**7, disk_cache_dir=str(tmp_path), redis_url=server.url)
        other = run(reader, "beta", ids, tenant="b" * 32)
        assert other[2].cached_tokens == 0 and other[2].tier_tokens == {}
        same = run(reader, "alpha-again", ids, tenant="a" * 32)
        assert same[2].cached_tokens == (len(ids) - 1) // BS * BS and set(same[2].tier_tokens) == {"disk"}
        reader.close()


# ---- faults in a tier cost hits, never answers ----------------------------------------------------


def test_a_full_disk_costs_writes_never_answers(checkpoints, cold, tmp_path, caplog):
    """Every block file's write fails with ENOSPC (its temporary file is /dev/full): the answer is the cold
    one, the failures are counted and logged, and nothing half written is left to be read."""
    import os

    ids = prompt(13)
    engine = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    disk = engine.tiers.disk
    for block_hash in engine.block_hashes(ids):
        path = disk._path(block_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("/dev/full", path.with_name(f".tmp-{path.name}.{os.getpid()}"))
    got = run(engine, "full", ids)
    same_answer(got, cold(ids))
    assert disk.writer.flush(10)
    stats = engine.snapshot()["tiers"]["disk"]
    assert stats["errors"] == stats["dropped_writes"] == len(engine.block_hashes(ids))
    assert "No space left on device" in caplog.text
    # only the block the answer filled (past the prompt) found room; no failed one is left to be read
    assert len(disk_files(tmp_path)) == disk.num_blocks == stats["written"] == 1
    engine.close()


def test_a_cache_folder_that_cannot_be_used_leaves_the_server_serving(checkpoints, cold, tmp_path, caplog):
    not_a_folder = tmp_path / "kv"
    not_a_folder.write_text("a file where the cache folder should be")
    engine = make(checkpoints[3], disk_cache_dir=str(not_a_folder))
    ids = prompt(14)
    same_answer(run(engine, "served", ids), cold(ids))
    assert engine.tiers.disk.writer.flush(10)
    assert engine.snapshot()["tiers"]["disk"]["errors"] >= 1 and "unusable" in caplog.text
    engine.close()


def test_a_redis_that_answers_slowly_is_a_miss_not_a_wait(checkpoints, cold):
    """CLIENT PAUSE stalls every client of the server: a read gives up after --redis-timeout, the request is
    answered without Redis, and hits resume once Redis answers again."""
    import time

    ids, later = prompt(15), prompt(16)
    with redis_server() as server:
        writer = make(checkpoints[3], redis_url=server.url)
        run(writer, "first", ids)
        run(writer, "second", later)
        assert writer.tiers.remote.writer.flush(10)
        writer.close()
        reader = make(checkpoints[3], redis_url=server.url, redis_timeout=0.2)
        server.client().execute_command("CLIENT", "PAUSE", "3000", "ALL")
        start = time.monotonic()
        got = run(reader, "paused", ids)
        assert time.monotonic() - start < 2.5  # well inside the pause: Redis was given up on, not waited for
        same_answer(got, cold(ids))
        assert got[2].tier_tokens == {} and reader.snapshot()["tiers"]["redis"]["errors"] >= 1
        time.sleep(3.2)
        reader.tiers.remote._retry_at = 0  # skip the pause before the next attempt
        again = run(reader, "answered", later)
        assert again[2].tier_tokens == {"redis": (len(later) - 1) // BS * BS}
        reader.close()


@pytest.mark.parametrize("tier_dtype", ["bf16", "int8"])
def test_tiers_can_keep_blocks_in_a_smaller_kv_dtype(checkpoints, cold, tmp_path, tier_dtype):
    """--tier-kv-dtype: the disk holds each block in fewer bytes; read back, it is converted to the pool's
    dtype (what a pool of that dtype would have held: close to the cold answer, not bit for bit), and files
    of another tier dtype are neither read nor deleted."""
    ids = prompt(17)
    full = make(checkpoints[3], disk_cache_dir=str(tmp_path))
    run(full, "fp32-copy", ids)
    full.close()
    writer = make(checkpoints[3], disk_cache_dir=str(tmp_path), tier_kv_dtype=tier_dtype)
    run(writer, "small-copy", ids)
    writer.close()
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert len(folders) == 2 and folders[1] == folders[0] + f"-{tier_dtype}"
    sizes = {name: next((tmp_path / name).rglob("*.kv")).stat().st_size for name in folders}
    assert writer.tiers.layout.nbytes <= 0.6 * writer.pool.layout.nbytes  # the payload, scales included
    # the files differ by the payloads, give or take their headers (a scales section is described too)
    assert sizes[folders[0]] - sizes[folders[1]] >= writer.pool.layout.nbytes - writer.tiers.layout.nbytes - 200
    reader = make(checkpoints[3], disk_cache_dir=str(tmp_path), tier_kv_dtype=tier_dtype)
    got = run(reader, "again", ids)
    full_blocks = (len(ids) - 1) // BS * BS
    assert got[2].tier_tokens == {"disk": full_blocks}
    assert got[1] == pytest.approx(cold(ids)[1], abs=0.05)
    assert reader.snapshot()["tiers"]["disk"]["corrupt"] == 0
    reader.close()
    assert len(list((tmp_path / folders[0]).rglob("*.kv"))) == len(disk_files(tmp_path / folders[0]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the asynchronous copy into pinned memory is the CUDA pool's"))])
@pytest.mark.parametrize("tier_dtype", [None, "bf16"])
def test_demoted_blocks_keep_their_kv_when_the_pool_reuses_their_ids_at_once(device, tier_dtype):
    """Demotion copies a block out while the engine goes on (on CUDA, asynchronously into pinned memory):
    what the host tier holds, and loads back, is the KV from before the ids were written again."""
    torch.manual_seed(SEED)
    pool = KVPool(2, 8, BS, 2, 16, device=device)
    shape = pool.layout.shape
    original = pool.layout.encode(torch.randn(8, *shape))
    pool.import_blocks(list(range(8)), original)
    expected = pool.export_blocks([0, 1, 2, 3], tier_dtype)
    tiers = KVTiers(pool, host=HostTier(10**8), dtype=tier_dtype)
    records = [BlockRecord(bytes([i + 1]) * 16, bytes([i]) * 16, bytes(range(BS * 4)), b"", i) for i in range(4)]
    tiers.removed(records)
    pool.import_blocks([0, 1, 2, 3], pool.layout.encode(torch.randn(4, *shape)))  # the ids handed out again
    held = tiers.host.get([r.hash for r in records])
    assert torch.equal(torch.stack([held[r.hash].payload() for r in records]).cpu(), expected)
    tiers.load([4, 5, 6, 7], [Found("host", held[r.hash]) for r in records])
    back = pool.layout.decode(pool.export_blocks([4, 5, 6, 7]))
    want = pool.layout.decode(original[:4])
    if tier_dtype is None:
        assert torch.equal(back, want)
    else:
        assert torch.allclose(back, want, rtol=1e-2, atol=1e-2)
