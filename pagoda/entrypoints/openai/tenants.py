"""Who sent a request (its tenant) and which prefix-cache salt it runs with.

The tenant is taken from one source, chosen with ``--tenant-id-source``: the API key the client
presented (a digest of it, never the key), the request's ``user`` field, a request header
(``--tenant-id-header``, for a gateway in front that knows the client), or none (one tenant for
all). A request whose source gives nothing runs as the default tenant. The scheduler shares
sequence slots and step tokens fairly between tenants.

``--tenant-cache-isolation`` salts every request's prefix cache with its tenant (joined with the
request's own ``cache_salt``), so no tenant's cached prefixes, cached-token counts or hit
counters tell anything about another tenant's prompts.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass

from fastapi import Request

from pagoda.request import DEFAULT_TENANT

TENANT_ID_SOURCES = ("api-key", "user", "header", "none")
DEFAULT_TENANT_ID_SOURCE = "api-key"
DEFAULT_TENANT_ID_HEADER = "X-Tenant-Id"
# Longer ids (a user field, a header) are replaced by a digest: ids become metric labels.
MAX_TENANT_ID_CHARS = 64
# A request made inside the server (a batch line) names its tenant in its ASGI scope under this
# key; no HTTP client can set a scope key.
TENANT_SCOPE_KEY = "pagoda.tenant"


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate from JSON is a value too


def _digest(text: str) -> str:
    return hashlib.sha256(_utf8(text)).hexdigest()[:16]


def _encodable(text: str) -> bool:
    """The engine's wire (msgpack) takes only valid UTF-8 text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class TenantPolicy:
    """How the server names a request's tenant and salts its prefix cache."""

    source: str = DEFAULT_TENANT_ID_SOURCE
    header: str = DEFAULT_TENANT_ID_HEADER
    cache_isolation: bool = False

    def tenant(self, raw: Request, user: str | None) -> str:
        """The tenant of a request: the one a request made inside the server was given, else its
        source's value, else the default tenant."""
        preset = raw.scope.get(TENANT_SCOPE_KEY)
        if preset is not None:
            return preset
        value: str | None = None
        if self.source == "api-key":
            scheme, _, token = raw.headers.get("authorization", "").partition(" ")
            value = "key-" + _digest(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        elif self.source == "user":
            value = user or None
        elif self.source == "header":
            value = raw.headers.get(self.header) or None
        if value is None:
            return DEFAULT_TENANT
        return value if len(value) <= MAX_TENANT_ID_CHARS and _encodable(value) else "sha-" + _digest(value)

    def cache_salt(self, tenant: str, salt: str | None) -> str | None:
        """The salt the engine gets, a digest (equal salts give equal digests; any text, a lone
        surrogate included, crosses to the engine as plain ASCII): of the request's own salt, or
        under isolation of the tenant and the request's salt together (a client's salt cannot
        name another tenant's)."""
        if not self.cache_isolation:
            return None if salt is None else "salt:" + hashlib.sha256(_utf8(salt)).hexdigest()
        return "tenant:" + hashlib.sha256(json.dumps([tenant, salt]).encode()).hexdigest()


def add_tenant_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant-id-source", default=DEFAULT_TENANT_ID_SOURCE, choices=TENANT_ID_SOURCES,
                        help="what names a request's tenant, between which the scheduler shares the engine fairly: "
                             "api-key (a digest of the bearer token the client sent), user (the request's 'user' "
                             "field), header (--tenant-id-header), none (everyone is one tenant); a request "
                             "without one runs as the default tenant")
    parser.add_argument("--tenant-id-header", default=DEFAULT_TENANT_ID_HEADER,
                        help="the request header that names the tenant with --tenant-id-source header")
    parser.add_argument("--tenant-cache-isolation", action="store_true",
                        help="salt the prefix cache per tenant: requests reuse cached prefixes only of their own "
                             "tenant, so cached_tokens and the cache hit counters tell nothing about other tenants")


def tenant_policy(args: argparse.Namespace) -> TenantPolicy:
    return TenantPolicy(getattr(args, "tenant_id_source", DEFAULT_TENANT_ID_SOURCE),
                        getattr(args, "tenant_id_header", DEFAULT_TENANT_ID_HEADER),
                        bool(getattr(args, "tenant_cache_isolation", False)))
