"""API keys held as digests: the tenant each key stands for (auth.py checks them on each request).

A tenant is the key's keyed BLAKE2b digest: stable across restarts for the same key, one length for every key
(so it can be folded into block hashes next to a cache_salt without ambiguity, see CacheOptions.namespace), and
not the key: it may end up in logs or, later, in KV tier storage, and the key cannot be recovered from it.
Keys are looked up by that digest, so how long a lookup takes says nothing about how much of a guess matched.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

# Domain separation for the digest; changing it would move every tenant to a new (empty) cache namespace.
_TENANT_DIGEST_KEY = b"kv-reuse-server tenant v1"


def key_digest(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=16, key=_TENANT_DIGEST_KEY).hexdigest()


def read_key_file(path: str | Path) -> list[str]:
    """One key a line; blank lines and lines starting with '#' are skipped, surrounding whitespace dropped."""
    keys = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


class ApiKeys:
    """The configured keys, held only as digests."""

    def __init__(self, tenant_keys: Iterable[str] = (), admin_keys: Iterable[str] = ()) -> None:
        self._tenants = {key_digest(k) for k in tenant_keys}
        self._admins = {key_digest(k) for k in admin_keys}

    @property
    def required(self) -> bool:
        return bool(self._tenants)

    @property
    def admin_required(self) -> bool:
        return bool(self._admins)

    def tenant(self, key: str | None) -> str | None:
        """The tenant of a valid tenant key; None for a missing or unknown one."""
        if key is None:
            return None
        digest = key_digest(key)
        return digest if digest in self._tenants else None

    def is_admin(self, key: str | None) -> bool:
        return key is not None and key_digest(key) in self._admins
