"""Who is reading GET /v1/cache/stats, and so which tenants' figures it may see (auth.py's `cache_viewer`
decides which from the key presented).

The whole-server figures (the pool, the tiers, hit and blend counters, the sizing) are everyone's, as vLLM,
SGLang and LMCache expose them; what a tenant did with the cache (its prompt-cache pins: how many, how large,
when they expire) is its own, so a tenant key sees only its own tenant's, and never that other tenants exist.
"""
from __future__ import annotations

from dataclasses import dataclass

from reuse_server.kv.pins import tenant_label


@dataclass(frozen=True)
class WholeServer:
    """The admin key, or anyone on a server started without keys: every tenant's pins."""

    def pins(self, section: dict) -> dict:
        return section


@dataclass(frozen=True)
class OneTenant:
    """A tenant key: its own pins, in the whole server's shape (its figures as the totals, itself the only
    tenant listed); the pin budget is a setting, the same for every tenant."""

    tenant: str

    def pins(self, section: dict) -> dict:
        label = tenant_label(self.tenant)
        own = section["tenants"].get(label)
        figures = {name: own[name] if own else 0 for name in ("pinned_blocks", "pinned_tokens", "pins", "given_way")}
        return {**figures, "budget_blocks_per_tenant": section["budget_blocks_per_tenant"],
                "tenants": {label: own} if own else {}}


CacheViewer = WholeServer | OneTenant
