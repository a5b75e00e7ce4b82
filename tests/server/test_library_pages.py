"""release_library_pages: a server's start-up-only library pages go back to the system; nothing else is touched."""
from __future__ import annotations

import ctypes
import shutil
import sys

import pytest

from reuse_server.server.library_pages import library_mappings, release_library_pages

MAPS = """\
7f0000000000-7f0000100000 r--p 00000000 fd:01 11 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so
7f0000100000-7f0000900000 r-xp 00100000 fd:01 11 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so
7f0000900000-7f0000a00000 rw-p 00900000 fd:01 11 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so
7f0001000000-7f0002000000 r--s 00000000 fd:01 12 /cache/smollm2/model.safetensors
7f0003000000-7f0003001000 r-xp 00000000 fd:01 13 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0
7f0004000000-7f0004001000 rw-p 00000000 00:00 0
7f0005000000-7f0005001000 r--p 00000000 fd:01 14 /cache/kv/0a1b.so.blob
"""


def test_only_read_only_library_mappings_are_chosen():
    assert library_mappings(MAPS) == [
        (0x7f0000000000, 0x7f0000100000),  # constants
        (0x7f0000100000, 0x7f0000900000),  # code
        (0x7f0003000000, 0x7f0003001000),  # a versioned soname
    ]  # not the written data, the weights' map, anonymous memory or a file that only contains ".so"


def _resident_kib(path: str) -> int:
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:  # a mapping's header line
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT is Linux's")
def test_a_library_no_one_else_maps_leaves_memory_and_still_runs(tmp_path):
    import _decimal
    # A copy under a name of its own: no other process maps its pages, so the kernel may drop them
    path = str(tmp_path / "private_copy.so")
    shutil.copy(_decimal.__file__, path)
    ctypes.CDLL(path)
    with open("/proc/self/maps") as f:
        maps = f.read()
    mine = library_mappings("\n".join(line for line in maps.splitlines() if line.endswith(path)))
    assert mine and set(mine) <= set(library_mappings(maps))
    for start, end in mine:  # fault every page in
        ctypes.string_at(start, end - start)
    before = _resident_kib(path)
    assert release_library_pages() > 0
    after = _resident_kib(path)
    print(f"private library resident: {before} KiB before, {after} KiB after")
    assert after < before
    # What this process still runs from its libraries faults back in
    import decimal
    assert str(decimal.Decimal(1) / decimal.Decimal(8)) == "0.125"
