"""API keys on each request (`Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients send it):
the FastAPI dependencies that find a request's tenant (api_keys.py holds the keys).

Without tenant keys the /v1 routes are open and requests have no tenant (the cache behaves as before);
/metrics (and admin routes) need an admin key only when one is configured. GET /v1/cache/stats takes either
kind of key: the admin key sees every tenant's figures, a tenant key only its own (cache_viewer.py).
"""
from __future__ import annotations

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from reuse_server.api.app_state import app_state
from reuse_server.api.cache_viewer import CacheViewer, OneTenant, WholeServer


class Unauthorized(Exception):
    """No valid API key; answered with 401 (errors.py)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


_bearer = HTTPBearer(auto_error=False, description="An API key given to the server with --api-key/--api-key-file "
                                                   "(or --admin-api-key for /metrics and every tenant's "
                                                   "/v1/cache/stats); needed only when the server was started "
                                                   "with keys.")


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


async def cache_viewer(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer),
                       x_api_key: str | None = Depends(_x_api_key)) -> CacheViewer:
    """Whose cache figures the caller may see: the admin key (or anyone, on a server without keys) every
    tenant's, a tenant key its own. Without tenant keys a non-admin caller is refused as on /metrics."""
    keys = app_state(request).settings.api_keys
    key = _presented(credentials, x_api_key)
    if keys.is_admin(key):
        return WholeServer()
    if keys.required:
        tenant = keys.tenant(key)
        if tenant is not None:
            return OneTenant(tenant)
    elif not keys.admin_required:
        return WholeServer()
    raise Unauthorized("This endpoint needs an API key, as 'Authorization: Bearer KEY' or 'x-api-key: KEY': "
                       "the server's admin key sees every tenant's figures, a tenant key its own.")
