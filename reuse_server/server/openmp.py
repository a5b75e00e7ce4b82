"""How torch's OpenMP threads wait between parallel regions (set before torch is imported).

libgomp's default spins ~300,000 iterations after each region: on a shared CPU (a client or load generator
on the same cores) an idle spinning thread steals the core another process needs. OMP_WAIT_POLICY=PASSIVE
fixes that but sleeps after every region, and a forward is hundreds of short regions, so a warm step pays a
wake-up per region. A short spin (GOMP_SPINCOUNT=3000) keeps back-to-back regions hot and gives the core up
quickly (measured in benchmarks/results/history.md). A user's own setting wins.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

SHORT_SPIN = {"GOMP_SPINCOUNT": "3000"}
_USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def with_short_spin(env: Mapping[str, str]) -> dict[str, str]:
    """env plus the short spin, unless env already says how OpenMP threads should wait."""
    out = dict(env)
    if not any(k in env for k in _USER_KNOBS):
        out.update(SHORT_SPIN)
    return out


def apply_short_spin(env: MutableMapping[str, str] = os.environ) -> None:
    env.update({k: v for k, v in with_short_spin(env).items() if k not in env})


def describe(env: Mapping[str, str] = os.environ) -> str:
    return ", ".join(f"{k}={env[k]}" for k in _USER_KNOBS if k in env) or "libgomp default"
