"""How large the KV cache is when the user does not say (`--kv-cache-memory auto`, `--cpu-cache-size auto`,
the defaults): the rules as pure functions of the machine's figures, so they are tested on any machine, and
the one reader of those figures (/proc/meminfo or psutil, and the cgroup's limit). Torch-free.

On the CPU the pool is host RAM, allocated with torch.zeros (kv/pool.py): committed at start. So the rule is
a share of what is available *at start*: a second server started a moment later sees the first one's pool
as used memory and takes its share of what is left, and several servers together never take more than the
share. The host tier is off there by default: in the same RAM it is a second copy (write-through keeps every
pool block in it too), filled lazily (not committed at start, so the safety above would not hold), and a hit
in it costs a copy back into the pool where a hit in a bigger pool costs nothing (BENCHMARKS.md, "Out of the
box: long-document QA", measures both at equal bytes).

On CUDA the pool is sized as vLLM's --gpu-memory-utilization: that share of the card's memory is this
server's, and the pool gets what the weights and a step's activations leave of it (never more than is free).
The host tier is then on by default, sized by the CPU rule: host RAM is a real second level below the card."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30

# The CPU rule. Half of what is available, less a reserve: the other half is the machine's (its other
# programs, the page cache, a client on the same box), the reserve this process's own growth after the pool
# is made (a step's activations, the response store's 256 MiB bound, the radix index, Python). The floor is
# what a tiny machine still gets (a few documents of SmolLM2); the ceiling bounds the start-up time spent
# zeroing the pool (~2 s for 16 GiB here) on a large host, twice llama-server's default --cache-ram of 8 GiB.
CPU_SHARE = 0.5
CPU_RESERVE = 1 * GiB
CPU_FLOOR = 256 * MiB
CPU_CEILING = 16 * GiB
# The CUDA rule: vLLM's default share of the card, and the headroom over the activation estimate (the
# estimate counts the big tensors of one step, not the allocator's fragmentation or the attention kernel's
# scratch).
GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_HEADROOM = 2.0


@dataclass(frozen=True)
class Auto:
    """A size decided at start from the machine (this module's rules), the default of both KV sizes."""

    def __str__(self) -> str:
        return "auto"


AUTO = Auto()


@dataclass(frozen=True)
class MachineMemory:
    """What the host has, in bytes, as read at one moment. cgroup_limit: the memory limit of this process's
    cgroup (a container's), None when unlimited; cgroup_usage: what the cgroup holds now."""
    total: int
    available: int
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None
    source: str = "given"

    @property
    def usable(self) -> int:
        """Available memory, within the cgroup's limit: a container's processes are killed at their limit
        whatever the host has free."""
        if self.cgroup_limit is None:
            return self.available
        return max(0, min(self.available, self.cgroup_limit - (self.cgroup_usage or 0)))


@dataclass(frozen=True)
class CardMemory:
    """One CUDA device, in bytes: its total, what is free now (after our weights are on it), what our weights
    take, and the estimate of one step's activations."""
    total: int
    free: int
    weight_bytes: int
    activation_bytes: int


@dataclass
class KVSizing:
    """What the start-up sizing decided and from what: logged once and shown in /v1/cache/stats."""
    pool: str  # "auto" or "explicit" (--kv-cache-memory SIZE or --num-gpu-blocks)
    host_tier: str  # "auto", "explicit" or "off"
    device: str
    pool_bytes: int  # the budget given to the pool (its blocks are whole: pool_blocks x block bytes <= it)
    host_tier_bytes: int
    why: str
    machine: dict | None = None  # MachineMemory's figures, where they were read
    card: dict | None = None  # CardMemory's figures, on CUDA
    rule: dict = field(default_factory=dict)  # the constants and shares the rule used
    pool_blocks: int | None = None  # filled in once the pool exists
    pool_tokens: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def log_line(self) -> str:
        parts = [f"KV cache sizing ({self.pool} pool, {self.host_tier} host tier): pool {_gib(self.pool_bytes)}"]
        if self.pool_blocks is not None:
            parts.append(f"{self.pool_blocks} blocks, {self.pool_tokens} tokens")
        parts.append(f"host tier {_gib(self.host_tier_bytes) if self.host_tier_bytes else 'off'}")
        return ", ".join(parts) + f": {self.why}"


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def cpu_budget(usable: int, replicas: int = 1, share: float = CPU_SHARE) -> int:
    """Bytes of host RAM for one server's KV cache when `replicas` servers divide what is usable now:
    share x (usable - a reserve per server) / replicas, within [CPU_FLOOR, CPU_CEILING]."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    spare = max(0, usable - replicas * CPU_RESERVE)
    return int(min(CPU_CEILING, max(CPU_FLOOR, share * spare / replicas)))


def size_for_cpu(machine: MachineMemory, pool: int | Auto, host_tier: int | Auto, share: float = CPU_SHARE,
                 device: str = "cpu", pool_flag: str = "--kv-cache-memory") -> KVSizing:
    """The pool and host tier of a server whose pool is host RAM. An explicit size wins (pool_flag: the flag
    that gave it); `auto` pool: the CPU budget; `auto` host tier: off (this module's doc says why)."""
    budget = cpu_budget(machine.usable, share=share)
    rule = dict(share=share, reserve_bytes=CPU_RESERVE, floor_bytes=CPU_FLOOR, ceiling_bytes=CPU_CEILING)
    if isinstance(pool, Auto):
        pool_bytes = budget
        limited = "" if machine.cgroup_limit is None else f", within the cgroup limit of {_gib(machine.cgroup_limit)}"
        bound = (" (the floor)" if pool_bytes == CPU_FLOOR else " (the ceiling)" if pool_bytes == CPU_CEILING
                 else "")
        why = (f"{share:g} x ({_gib(machine.usable)} available at start{limited} - {_gib(CPU_RESERVE)} reserve) "
               f"= {_gib(pool_bytes)}{bound}")
    else:
        pool_bytes, why = pool, f"{pool_flag} as given"
    if isinstance(host_tier, Auto):
        tier_bytes, tier_mode = 0, "off"
        why += "; host tier off on the CPU: it would be a second copy in the same RAM, so the pool takes it all"
    else:
        tier_bytes, tier_mode = host_tier, "explicit" if host_tier else "off"
    return KVSizing(pool="auto" if isinstance(pool, Auto) else "explicit", host_tier=tier_mode, device=device,
                    pool_bytes=pool_bytes, host_tier_bytes=tier_bytes, why=why, machine=_figures(machine),
                    rule=rule)


def gpu_pool_bytes(card: CardMemory, utilization: float = GPU_MEMORY_UTILIZATION) -> int:
    """vLLM's --gpu-memory-utilization: of `utilization` x the card's memory, what the weights and a step's
    activations leave for the pool; never more than is free now less the activations (another process may
    hold the rest). ValueError when nothing is left."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    activations = int(card.activation_bytes * ACTIVATION_HEADROOM)
    ours = int(utilization * card.total) - card.weight_bytes - activations
    pool = min(ours, card.free - activations)
    if pool <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:g} x {_gib(card.total)} less the weights "
            f"({_gib(card.weight_bytes)}) and a step's activations ({_gib(activations)}) leaves {_gib(ours)}, and "
            f"{_gib(card.free)} is free; raise --gpu-memory-utilization or lower --max-num-batched-tokens")
    return pool


def size_for_gpu(card: CardMemory, machine: MachineMemory, pool: int | Auto, host_tier: int | Auto,
                 utilization: float = GPU_MEMORY_UTILIZATION, share: float = CPU_SHARE,
                 device: str = "cuda", pool_flag: str = "--kv-cache-memory") -> KVSizing:
    """The pool on the card (an explicit size wins) and the host tier in host RAM (auto: the CPU budget)."""
    if isinstance(pool, Auto):
        pool_bytes = gpu_pool_bytes(card, utilization)
        why = (f"{utilization:g} x {_gib(card.total)} of the card - {_gib(card.weight_bytes)} weights - "
               f"{ACTIVATION_HEADROOM:g} x {_gib(card.activation_bytes)} activations = {_gib(pool_bytes)} "
               f"({_gib(card.free)} free)")
    else:
        pool_bytes, why = pool, f"{pool_flag} as given"
    if isinstance(host_tier, Auto):
        tier_bytes, tier_mode = cpu_budget(machine.usable, share=share), "auto"
        why += (f"; host tier {share:g} x ({_gib(machine.usable)} of host RAM available - {_gib(CPU_RESERVE)}) "
                f"= {_gib(tier_bytes)}")
    else:
        tier_bytes, tier_mode = host_tier, "explicit" if host_tier else "off"
    return KVSizing(pool="auto" if isinstance(pool, Auto) else "explicit", host_tier=tier_mode, device=device,
                    pool_bytes=pool_bytes, host_tier_bytes=tier_bytes, why=why, machine=_figures(machine),
                    card=asdict(card),
                    rule=dict(gpu_memory_utilization=utilization, activation_headroom=ACTIVATION_HEADROOM,
                              share=share, reserve_bytes=CPU_RESERVE, floor_bytes=CPU_FLOOR,
                              ceiling_bytes=CPU_CEILING))


def activation_bytes(hidden: int, intermediate: int, q_width: int, kv_width: int, vocab: int, tokens: int,
                     sequences: int, element_bytes: int) -> int:
    """The big tensors one step of `tokens` tokens holds at once: per token the residual, the normed input,
    q/k/v and the attention output, the MLP's gate, up and product, and the logits of each sequence's last
    token (fp32)."""
    per_token = 3 * hidden + q_width + 2 * kv_width + q_width + 3 * intermediate
    return tokens * per_token * element_bytes + sequences * vocab * 4


def _figures(machine: MachineMemory) -> dict:
    return {**asdict(machine), "usable": machine.usable}


# ---- reading the machine ---------------------------------------------------------------------------------


def read_machine_memory(root: Path = Path("/")) -> MachineMemory:
    """Total and available host RAM (/proc/meminfo's MemAvailable; psutil where there is no /proc) and this
    process's cgroup memory limit and usage (v2, else v1)."""
    meminfo = _meminfo(root / "proc" / "meminfo")
    if meminfo is not None:
        total, available, source = meminfo["MemTotal"], meminfo["MemAvailable"], "/proc/meminfo"
    else:
        import psutil  # not on Linux: psutil reads the platform's figures

        vm = psutil.virtual_memory()
        total, available, source = vm.total, vm.available, "psutil"
    limit, usage = _cgroup(root)
    return MachineMemory(total=total, available=available, cgroup_limit=limit, cgroup_usage=usage, source=source)


def _meminfo(path: Path) -> dict[str, int] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out if "MemTotal" in out and "MemAvailable" in out else None


# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number
_V1_UNLIMITED = 1 << 60


def _cgroup(root: Path) -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup, or of the ancestor with the least room under its limit
    (limits nest: a parent's binds its children); (None, None) when none has a limit. A container whose
    cgroup namespace hides the path sees its own cgroup at the hierarchy's root, which is read last."""
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    found: list[tuple[int, int]] = []
    for line in lines:  # "0::/path" (v2) or "4:memory:/path" (v1)
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, limit_file, usage_file = root / "sys" / "fs" / "cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file = (root / "sys" / "fs" / "cgroup" / "memory", "memory.limit_in_bytes",
                                            "memory.usage_in_bytes")
        else:
            continue
        rel = Path(path.lstrip("/"))
        for level in [rel, *rel.parents]:
            limit = _read_int(base / level / limit_file)
            if limit is not None and limit < _V1_UNLIMITED:
                found.append((limit, _read_int(base / level / usage_file) or 0))
    if not found:
        return None, None
    return min(found, key=lambda lu: lu[0] - lu[1])


def _read_int(path: Path) -> int | None:
    """An integer file of the cgroup filesystem; None for 'max' (no limit) or a file that is not there."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
