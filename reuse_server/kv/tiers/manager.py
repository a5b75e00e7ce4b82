"""The tiers below the device pool, as the engine sees them: where evicted blocks go, where new blocks are
written, and where a prompt's missing blocks are looked for (host RAM, then disk, then Redis, by block hash).

- It listens to the radix cache (radix.events): every new full block is copied to host RAM as it is computed
  (`host_write_policy` "through", as vLLM's CPU offloading and LMCache store what they compute), so the pool
  evicts it later without a copy in the step that needs its id, often a tier hit's; with "back" a block is
  copied out when the pool evicts it (host RAM then holds more distinct blocks). Without host RAM, with
  write-back, evicted blocks go to disk. Every new full block is written through to disk (unless
  `write_policy` is "back": then only what host RAM evicts) and to Redis.
- `held` says which of a prompt's blocks the tiers hold, and `fetch` reads them into the pool blocks the
  block manager took for them: those continuing its cached chain (then filed in the radix tree, which only
  the block manager changes: prefetch, the chunk index and every admission), or blocks anywhere after a hole
  (a block in no tier), read into the sequence's own blocks, so only the hole is recomputed; their KV depends
  only on the tokens before them. Disk files and Redis values are read straight into the pool's memory
  (KVPool.read_targets: no buffer in between, no copy after, no fresh memory to fault in on a hit); host
  RAM's blocks are copied in (`load`, which also takes what was read into a buffer where the pool cannot
  take reads in place).
- Every block found is checked against what was asked (hash, parent hash, tokens) before it is used, and
  is fetched only where that is measured to be cheaper than recomputing it (tiers/costs.py)."""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch
from radix import BlockRecord, as_token_array

from reuse_server.kv.pool import KVPool
from reuse_server.kv.tiers.blob import BlockEntry
from reuse_server.kv.tiers.costs import FetchCosts
from reuse_server.kv.tiers.host import HostTier
from reuse_server.kv.tiers.stats import Lookups, figures
from reuse_server.kv.tiers.tier import Tier

log = logging.getLogger(__name__)

WRITE_POLICIES = ("through", "back")


class Wanted(NamedTuple):
    index: int  # the block's position in its prompt (block i holds tokens i*bs .. (i+1)*bs - 1)
    hash: bytes
    parent_hash: bytes
    tokens: bytes  # little-endian int32


class Found(NamedTuple):
    tier: str
    entry: BlockEntry


class Held(NamedTuple):
    """What KVTiers.held found: the wanted blocks a tier holds, and the tiers to read them from."""

    blocks: list[Wanted]
    tiers: tuple[str, ...]


class KVTiers:
    def __init__(self, pool: KVPool, host: HostTier | None = None, disk: Tier | None = None, remote: Tier | None = None,
                 write_policy: str = "through",
                 dtype: torch.dtype | None = None, fetch: str = "auto", host_write_policy: str = "through"):
        """dtype: what the tiers store blocks in (None: the pool's own); blocks are converted on the way out
        and back."""
        for policy in (write_policy, host_write_policy):
            if policy not in WRITE_POLICIES:
                raise ValueError(f"unknown write policy {policy!r}; choose {', '.join(WRITE_POLICIES)}")
        self.pool = pool
        self.host, self.disk, self.remote = host, disk, remote
        self.levels: list[Tier] = [t for t in (host, disk, remote) if t is not None]
        self.lookups = {t.name: Lookups() for t in self.levels}  # this class's counts; each tier writes its own stats
        self.write_policy = write_policy
        self.host_write_policy = host_write_policy
        self.dtype = dtype
        self.layout = pool.layout_for(dtype)
        self.costs = FetchCosts(pool.block_size, always=fetch == "always")
        self.events = None  # kv.events.KVEvents: told where each block goes (None: nobody asks)
        if host is not None:
            host.on_evict = self._host_evicted

    def _host_evicted(self, entries: list[BlockEntry]) -> None:
        if self.events is not None:
            self.events.tier_removed(self.host.name, entries)
        if self.disk is not None and self.write_policy == "back":  # what leaves RAM goes to disk
            self.disk.put(entries)
            if self.events is not None:
                self.events.tier_stored(self.disk.name, entries)

    # ---- the radix cache's listener --------------------------------------------------------
    def stored(self, records: list[BlockRecord]) -> None:
        through = (self.host if self.host_write_policy == "through" else None,
                   self.disk if self.write_policy == "through" else None, self.remote)
        targets = [t for t in through if t is not None]
        if targets:
            self._copy_out([r for r in records if r.named], targets)

    def removed(self, records: list[BlockRecord]) -> None:
        records = [r for r in records if r.named]
        target = self.host or (self.disk if self.write_policy == "back" else None)
        if target is None:
            return
        if target is self.host and self.host_write_policy == "through":
            # already copied when computed: now that RAM is their only copy they count as just used there
            self.host.touch([r.hash for r in records])
        self._copy_out(records, [target])  # what RAM lacks (it let it go since, or it was never whole)

    def _copy_out(self, records: list[BlockRecord], targets: list) -> None:
        """Copy the blocks' KV out of the pool now (their ids may be handed out right after) and give it to
        the tiers that lack it. From a CUDA pool the copy into host memory goes on while the engine runs its
        next step; whoever reads the bytes waits for it (BlockEntry.payload)."""
        # a hybrid pool's block whose window part was dropped is not whole: its KV is not a tier's to keep
        records = [r for r in records if self.pool.exportable(r.block_id)
                   and any(t.contains(r.hash) is not True for t in targets)]
        if not records:
            return
        # a block host RAM holds already (a tier hit, written below again) is handed on as it is there: a
        # second copy out of the pool would cost the hit's step its memcpy
        kept = self.host.peek([r.hash for r in records]) if self.host is not None else {}
        export = [r for r in records if r.hash not in kept]
        # into the host tier's memory where it takes them (pinned beside a CUDA pool: the copy goes straight there)
        into = self.host.memory if self.host is not None and self.host in targets else None
        kv, copied = (self.pool.export_blocks_async([r.block_id for r in export], self.dtype, into) if export
                      else ([], None))
        made = {r.hash: BlockEntry(r.hash, r.parent_hash, r.tokens, r.namespace, kv[i], copied)
                for i, r in enumerate(export)}
        entries = [kept.get(r.hash) or made[r.hash] for r in records]
        for tier in targets:
            tier.put(entries)
            if self.events is not None:
                self.events.tier_stored(tier.name, entries)

    # ---- finding blocks --------------------------------------------------------------------
    def held(self, wanted: list[Wanted], contiguous: bool) -> Held:
        """The blocks of `wanted` (in chain order) that the tiers worth reading from hold now: what `fetch`
        finds unless a read fails, so the caller takes that many pool blocks to fetch them into. contiguous:
        only the unbroken run from the first. Each tier's fetch-or-recompute decision is taken here (and its
        declines counted), for the fetch that follows; Redis is asked (EXISTS, one pipeline) for the blocks
        no tier above it holds."""
        held = [False] * len(wanted)
        position = {w.index: i for i, w in enumerate(wanted)}
        reading = []
        for tier in self.levels:
            ask = [wanted[i] for i, h in enumerate(held) if not h]
            maybe = [w for w in ask if tier.contains(w.hash) is not False]
            if contiguous:
                maybe = self._leading_run(maybe, ask)
            if not maybe:
                continue
            if not self.costs.worth_fetching(tier.name):
                lookups = self.lookups[tier.name]
                lookups.queries += len(maybe)
                lookups.declined += len(maybe)
                continue
            reading.append(tier.name)
            for w, holds in zip(maybe, tier.holds([w.hash for w in maybe])):
                held[position[w.index]] = holds
        if contiguous:
            blocks = wanted[:next((i for i, h in enumerate(held) if not h), len(wanted))]
        else:
            blocks = [w for w, h in zip(wanted, held) if h]
        return Held(blocks, tuple(reading) if blocks else ())

    def fetch(self, wanted: list[Wanted], contiguous: bool, into: dict[int, int] | None = None,
              tiers: tuple[str, ...] | None = None) -> dict[int, Found]:
        """Verified blocks for `wanted` (in chain order), by index. contiguous: only an unbroken run from the
        first wanted block is any use. into: the pool block each wanted block goes into, by index (the caller
        took them); each block found is then in its pool block when this returns, read straight into it
        where the pool allows (KVPool.read_targets: disk and Redis reads; the entries' kv is None) or copied
        in (host RAM, or through the tier's read buffer); a block not found leaves its pool block holding
        anything, for the caller to give back or compute. tiers: the tiers to read from, as `held` decided
        (None: each tier is weighed here)."""
        targets = None
        if into is not None and wanted:
            views = self.pool.read_targets([into[w.index] for w in wanted], self.layout)
            if views is not None:
                targets = {w.hash: v for w, v in zip(wanted, views)}
        found: dict[int, Found] = {}
        missing = list(wanted)
        for tier in self.levels:
            if not missing:
                break
            ask = [w for w in missing if tier.contains(w.hash) is not False]
            if contiguous:
                ask = self._leading_run(ask, missing)
            if not ask:
                continue
            if tiers is not None and tier.name not in tiers:
                continue
            lookups = self.lookups[tier.name]
            lookups.queries += len(ask)
            if tiers is None and not self.costs.worth_fetching(tier.name):
                lookups.declined += len(ask)
                continue
            start = time.perf_counter()
            # After `held` the tier was just asked what it holds: it reads them all, without asking again
            # where a chain breaks (Redis: a second EXISTS pipeline); a block gone meanwhile still ends the
            # run below
            got = tier.get([w.hash for w in ask], contiguous=contiguous and tiers is None, into=targets)
            seconds = time.perf_counter() - start
            lookups.read_seconds += seconds
            self.costs.observe_read(tier.name, len(got), seconds)
            for w in ask:
                entry = got.get(w.hash)
                if entry is None:
                    continue
                if entry.tokens != w.tokens or entry.parent_hash != w.parent_hash:
                    log.warning("%s tier: block %s holds other tokens; dropped", tier.name, w.hash.hex())
                    lookups.mismatched += 1
                    tier.discard(w.hash)
                    continue
                found[w.index] = Found(tier.name, entry)
            missing = [w for w in missing if w.index not in found]
        if contiguous:
            run = {}
            for w in wanted:
                if w.index not in found:
                    break
                run[w.index] = found[w.index]
            found = run
        for tier in self.levels:  # hits: the blocks used (not those after a gap in a chain)
            self.lookups[tier.name].hits += sum(f.tier == tier.name for f in found.values())
        if into is not None:  # what is not in its pool block yet (host RAM's entries, a read buffer's rows)
            copy = sorted(i for i, f in found.items() if f.entry.kv is not None)
            self.load([into[i] for i in copy], [found[i] for i in copy])
        return found

    def partial(self, parent_hash: bytes, tokens: list[int]) -> "tuple[Found, int] | None":
        """The held block continuing `parent_hash` whose tokens start the most like `tokens` (a prompt that
        leaves a cached one inside this block), and how many of them it shares; None if none shares any.
        Only host RAM is asked: it finds a block's children without a read."""
        if self.host is None or not self.costs.worth_fetching(self.host.name):
            return None
        want = as_token_array(tokens).tobytes()
        best, shared = None, 0
        for entry in self.host.children(parent_hash):
            n = _shared_tokens(entry.tokens, want)
            if n > shared:
                best, shared = entry, n
        if best is None:
            return None
        lookups = self.lookups[self.host.name]
        lookups.queries += 1
        entry = self.host.get([best.hash]).get(best.hash)  # counted as read, and now the most recently used
        if entry is None:
            return None
        lookups.hits += 1
        return Found(self.host.name, entry), shared

    @staticmethod
    def _leading_run(ask: list[Wanted], missing: list[Wanted]) -> list[Wanted]:
        """The asked blocks that could still extend an unbroken run: those before the first missing block
        this tier does not hold."""
        asked = {w.index for w in ask}
        out = []
        for w in missing:
            if w.index not in asked:
                break
            out.append(w)
        return out

    def wanted(self, hasher, tokens: list[int], hashes: list[bytes], namespace: bytes, first: int) -> list[Wanted]:
        """What to ask for blocks first .. len(hashes) - 1 of a prompt whose block hashes are `hashes`."""
        bs = self.pool.block_size
        data = as_token_array(tokens[:len(hashes) * bs]).tobytes()
        root = hasher.root(namespace)
        return [Wanted(i, hashes[i], hashes[i - 1] if i else root, data[i * bs * 4:(i + 1) * bs * 4])
                for i in range(first, len(hashes))]

    def load(self, blocks: list[int], found: list[Found]) -> None:
        """Write found blocks' KV into pool blocks (the caller owns them). The copy's time is part of each
        tier's read time (by its share of the bytes): for host RAM it is most of it."""
        if not blocks:
            return
        start = time.perf_counter()
        self.pool.import_rows(blocks, [f.entry.payload() for f in found], self.layout)
        seconds = time.perf_counter() - start
        for name, lookups in self.lookups.items():
            share = sum(f.tier == name for f in found) / len(found)
            lookups.read_seconds += seconds * share

    # ---- shared writes -----------------------------------------------------------------------
    def shared_write_mark(self) -> int | None:
        """Where the shared tier's (Redis's) writer stands now: every block the pool has published so far has
        been handed to it. None without a shared tier."""
        return self.remote.writer.mark() if self.remote is not None else None

    def shared_writes_settled(self, mark: int, timeout: float = 0.0) -> bool:
        """Whether the blocks handed to the shared tier before `mark` are written (or dropped), waiting up to
        `timeout` seconds: another server can then find them."""
        return self.remote.writer.settled(mark, timeout)

    # ---- lifecycle and figures -------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.costs.observe_prefill(tokens, seconds)

    def close(self, timeout: float = 10.0) -> bool:
        """Write what is queued (up to `timeout` seconds in all), then stop the writers."""
        deadline = time.monotonic() + timeout
        done = True
        for tier in self.levels:
            done = tier.close(max(0.0, deadline - time.monotonic())) is not False and done
        return done

    def snapshot(self) -> dict:
        out = {}
        for tier in self.levels:
            stats = figures(tier.stats, self.lookups[tier.name])
            stats.update(blocks=tier.num_blocks, bytes=tier.used_bytes, write_queue_bytes=tier.write_queue_bytes)
            out[tier.name] = stats
        return out


def _shared_tokens(held: bytes, wanted: bytes) -> int:
    """How many leading int32 tokens two token strings share."""
    n = 0
    for i in range(0, min(len(held), len(wanted)), 4):
        if held[i:i + 4] != wanted[i:i + 4]:
            break
        n += 1
    return n
