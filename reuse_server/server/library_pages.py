"""Hand back the pages of shared libraries that only start-up touched.

Importing torch runs the static initialisers of its libraries (thousands of operator registrations) and the
kernel maps their code and data in large page-cache folios, so a server holds well over a hundred MiB of
library pages that its requests never touch again. MADV_PAGEOUT after start-up unmaps them from this process
(and drops them from the page cache where no one else maps them); what a request does use faults back in on
first use. Only read-only mappings are advised: a library's writable data holds pages written at start-up,
which the kernel could only move to swap.
"""
from __future__ import annotations

import ctypes
import logging
import re
import sys

log = logging.getLogger(__name__)

MADV_PAGEOUT = 21  # Linux 5.4+
# A shared library's file mapping (libfoo.so, libfoo.so.1.2, cpython-311-x86_64-linux-gnu.so): never the
# weights, a KV file or anything else a request reads through a memory map.
_LIBRARY = re.compile(r"\.so(\.\d+)*$")


def library_mappings(maps: str) -> list[tuple[int, int]]:
    """(start, end) of each read-only file mapping of a shared library (its code and constants) in a
    /proc/<pid>/maps text."""
    spans = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "w" not in fields[1] and _LIBRARY.search(fields[5].strip()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


def release_library_pages() -> int:
    """Page out this process's shared-library mappings. Returns the bytes of mappings advised (0 where the
    system cannot: not Linux, a kernel before 5.4)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        with open("/proc/self/maps") as f:
            spans = library_mappings(f.read())
    except (OSError, AttributeError):
        return 0
    advised = 0
    for start, end in spans:
        if madvise(start, end - start, MADV_PAGEOUT) == 0:
            advised += end - start
    log.debug("paged out %.0f MiB of shared-library mappings after start-up", advised / (1 << 20))
    return advised
