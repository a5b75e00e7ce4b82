"""API keys (`Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients send it) and the tenant
each one stands for.

A tenant is the key's keyed BLAKE2b digest: stable across restarts for the same key, one length for every key
(so it can be folded into block hashes next to a cache_salt without ambiguity, see CacheOptions.namespace), and
not the key: it may end up in logs or, later, in KV tier storage, and the key cannot be recovered from it.
Keys are looked up by that digest, so how long a lookup takes says nothing about how much of a guess matched.

Without tenant keys the /v1 routes are open and requests have no tenant (the cache behaves as before);
/metrics (and admin routes) need an admin key only when one is configured.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from reuse_server.api.app_state import app_state

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


class Unauthorized(Exception):
    """No valid API key; answered with 401 (errors.py)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


_bearer = HTTPBearer(auto_error=False, description="An API key given to the server with --api-key/--api-key-file "
                                                   "(or --admin-api-key for /metrics); needed only when the "
                                                   "server was started with keys.")


_x_api_key = APIKeyHeader(name="x-api-key", auto_error=False,
                          description="The same API key in Anthropic's header (the anthropic SDK sends it).")


def _presented(credentials: HTTPAuthorizationCredentials | None, x_api_key: str | None = None) -> str | None:
    return credentials.credentials if credentials is not None else x_api_key


async def require_tenant(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer),
                         x_api_key: str | None = Depends(_x_api_key)) -> None:
    """Sets request.state.tenant: the key's tenant, or None when the server has no tenant keys."""
    keys = app_state(request).settings.api_keys
    request.state.tenant = None
    if not keys.required:
        return
    tenant = keys.tenant(_presented(credentials, x_api_key))
    if tenant is None:
        raise Unauthorized("Incorrect or missing API key: send a key the server was configured with, "
                           "as 'Authorization: Bearer KEY' or 'x-api-key: KEY'.")
    request.state.tenant = tenant


async def require_admin(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    keys = app_state(request).settings.api_keys
    if keys.admin_required and not keys.is_admin(_presented(credentials)):
        raise Unauthorized("This endpoint needs the server's admin API key, as 'Authorization: Bearer KEY'.")
