"""A finished request's blocks reach Redis before its answer does, so the next turn of a conversation finds
them on any replica: the background writer's mark/settled, and a real server whose Redis is held busy (a Lua
script) while the request's last blocks are written."""
from __future__ import annotations

import json
import threading
import time

import httpx
import torch
from redis import Redis

from redis_server import redis_server
from reuse_server.kv.tiers.blob import BlockEntry
from reuse_server.kv.tiers.stats import TierStats
from reuse_server.kv.tiers.writer import BackgroundWriter
from server_process import metric, running_server, scrape

BS = 4
# Busy-waits inside Redis for ARGV[1] microseconds: every other client's command waits behind it.
BUSY_SCRIPT = """
local t0 = redis.call('TIME')
while true do
  local t = redis.call('TIME')
  if (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1]) then return 1 end
end
"""


def entry(i: int) -> BlockEntry:
    return BlockEntry(bytes([i]) * 16, bytes(16), bytes(16), b"", torch.zeros(8, dtype=torch.uint8))


def test_settled_waits_for_the_blocks_handed_over_before_the_mark():
    release = threading.Event()
    written = []

    def slow_write(batch):
        release.wait(10)
        written.extend(batch)

    writer = BackgroundWriter("test", slow_write, TierStats(), max_bytes=1 << 20)
    writer.put([entry(1), entry(2)])
    mark = writer.mark()
    assert mark == 2 and not writer.settled(mark, timeout=0.1)  # the write is still held
    release.set()
    assert writer.settled(mark, timeout=10) and len(written) == 2
    writer.put([entry(3)])
    assert writer.mark() == 3 and writer.settled(writer.mark(), timeout=10) and len(written) == 3
    assert writer.close(5)


def test_blocks_dropped_for_a_full_queue_do_not_hold_the_mark():
    release = threading.Event()
    writer = BackgroundWriter("test", lambda batch: release.wait(10), TierStats(), max_bytes=8)
    writer.put([entry(1)])
    writer.put([entry(2)])  # over the byte bound: dropped and counted, and settled at once
    assert writer.stats.dropped_writes == 1 and not writer.settled(writer.mark(), timeout=0.1)
    release.set()
    assert writer.settled(writer.mark(), timeout=10)
    writer.close(5)


def test_the_answer_waits_for_its_last_blocks_to_be_written(tiny_llama_path, tmp_path):
    with redis_server() as redis, running_server(
            tiny_llama_path, tmp_path / "s.log", "--block-size", str(BS), "--num-gpu-blocks", "256",
            "--no-blend-key-shift", "--redis-url", redis.url, "--redis-timeout", "5") as url:
        busy = Redis.from_url(redis.url, socket_timeout=30)  # its script runs longer than the helper's timeout
        busy.ping()
        script_done = []

        def hold_redis(seconds: float) -> None:
            busy.eval(BUSY_SCRIPT, 0, int(seconds * 1e6))
            script_done.append(time.monotonic())

        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "the quick brown fox " * 5, "max_tokens": 60,
                                "stream": True, "ignore_eos": True,
                                "stream_options": {"include_usage": True}}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # prefilled: decoding now
            # Redis is busy while the decode publishes its last blocks: their write waits behind the script
            holder = threading.Thread(target=hold_redis, args=(2.5,))
            holder.start()
            body = list(lines)
            stream_done = time.monotonic()
        holder.join(10)
        assert "data: [DONE]" in body
        # the last chunk came only after Redis was free again (without the wait it comes as soon as the decode
        # ends, seconds earlier)
        assert stream_done >= script_done[0] - 0.05, f"the answer came {script_done[0] - stream_done:.2f} s early"
        usage = [u for line in body if line.startswith("data: {") and (u := json.loads(line[5:]).get("usage"))][-1]
        # and the blocks were written, not dropped: every full block of what was computed (the last sampled
        # token has no KV yet); /metrics is read from a snapshot the idle engine refreshes twice a second
        computed = usage["prompt_tokens"] + usage["completion_tokens"] - 1
        deadline = time.monotonic() + 5
        while True:
            m = scrape(url)
            written = metric(m, "kvreuse_tier_written_blocks_total", tier="redis")
            if written == computed // BS or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert written == computed // BS and metric(m, "kvreuse_tier_dropped_writes_total", tier="redis") == 0
