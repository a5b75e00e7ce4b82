import os

# torch's CPU allocator asks the kernel for transparent huge pages only when this is set (c10 reads it once,
# at the first allocation, so before torch is imported): a tier hit's copies, an export's buffers and a
# prefill's activations are hundreds of MB of fresh memory, which otherwise fault in 4 KiB at a time
# (BENCHMARKS.md, "KV tiers"). A user's own setting wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
