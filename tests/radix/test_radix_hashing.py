"""Chained block hashing: determinism, chaining, salts, algorithms, block sizes, token input."""
import numpy as np
import pytest

from radix import BlockHasher, check_block_size


def test_each_full_block_gets_one_hash_and_a_partial_block_none():
    hasher = BlockHasher(block_size=4)
    assert len(hasher.hash_blocks(list(range(10)))) == 2
    assert len(hasher.hash_blocks(list(range(12)))) == 3
    assert hasher.hash_blocks([1, 2, 3]) == []


def test_hash_is_chained_on_the_whole_prefix():
    hasher = BlockHasher(block_size=4)
    a = hasher.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8])
    b = hasher.hash_blocks([9, 2, 3, 4, 5, 6, 7, 8])  # same second block, different first
    assert a[0] != b[0]
    assert a[1] != b[1]
    # the chain can be resumed from a parent hash
    assert hasher.hash_blocks([5, 6, 7, 8], parent=a[0]) == [a[1]]


def test_same_tokens_hash_the_same_for_lists_and_any_int_array():
    hasher = BlockHasher(block_size=16)
    tokens = np.random.default_rng(0).integers(0, 100_000, 100)
    expected = hasher.hash_blocks(tokens.tolist())
    assert hasher.hash_blocks(tokens.astype(np.int64)) == expected
    assert hasher.hash_blocks(tokens.astype(np.int32)) == expected
    assert hasher.hash_blocks(tokens.astype(np.uint32)[::-1][::-1]) == expected


def test_namespace_identity_and_algorithm_separate_hashes():
    tokens = list(range(32))
    base = BlockHasher(16).hash_blocks(tokens)
    assert BlockHasher(16).hash_blocks(tokens, namespace=b"tenant-a") != base
    assert BlockHasher(16, identity=b"another model").hash_blocks(tokens) != base
    sha = BlockHasher(16, algo="sha256").hash_blocks(tokens)
    assert len(sha[0]) == 32 and len(base[0]) == 16
    assert BlockHasher(16, algo="sha256", identity=b"m").hash_blocks(tokens) != sha
    # identity and namespace cannot trade bytes: ("ab", "") and ("a", "b") are different roots
    assert BlockHasher(16, identity=b"ab").root(b"") != BlockHasher(16, identity=b"a").root(b"b")


def test_hashes_are_the_same_in_every_process():
    """A block's hash is its name outside the process (tiers, other servers): it must not depend on the
    process (Python's hash() is salted per process), only on the identity, namespace and tokens."""
    import subprocess
    import sys
    code = ("from radix import BlockHasher; "
            "print(BlockHasher(4, identity=b'fp').hash_blocks(list(range(12)), namespace=b'ns')[-1].hex())")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout for seed in (1, 2)}
    assert runs == {BlockHasher(4, identity=b"fp").hash_blocks(list(range(12)), namespace=b"ns")[-1].hex() + "\n"}


def test_truncated_hashes_keep_only_the_low_bits():
    hasher = BlockHasher(block_size=1, truncate_bits=3)
    hashes = hasher.hash_blocks(list(range(200)))
    values = {int.from_bytes(h, "little") for h in hashes}
    assert values <= set(range(8)) and len(values) > 1


@pytest.mark.parametrize("bad", [0, 3, 24, 1024, -16, 16.0, True, "16"])
def test_block_size_must_be_a_power_of_two_up_to_512(bad):
    with pytest.raises(ValueError, match="power of two"):
        check_block_size(bad)


@pytest.mark.parametrize("good", [1, 2, 16, 512])
def test_valid_block_sizes(good):
    assert check_block_size(good) == good


def test_unknown_algorithm_and_bad_tokens_are_rejected():
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        BlockHasher(16, algo="md5")
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        BlockHasher(1).hash_blocks([1, -2])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        BlockHasher(1).hash_blocks([2**40])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        BlockHasher(1).hash_blocks(np.array([2**40]))
