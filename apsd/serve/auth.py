"""API keys: who is calling, decided from ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``).

Ownership: a :class:`KeyRing` is built from a validated :class:`~apsd.core.config.Config`
(tenants' ``api_key_hashes``, the keys issued through ``/admin`` (``Config.keys``: a tenant's key then
names its key id), ``[auth] admin_key_hashes``, ``admin_keys`` and ``metrics_key_hashes``) and is immutable;
the HTTP layer keeps the one built from the pipeline's current config (rebuilt when a
reload replaces the config: :mod:`apsd.serve.http.common`) and asks :meth:`KeyRing.identify`
before it reads a request's body.

The rules (docs/how-to/api-keys.md says them for operators):

* The config stores only ``sha256:<hex>`` hashes of keys. Keys are random
  (``apsd hash-key --new`` makes one with 256 bits of entropy), so one unsalted
  SHA-256 is enough: there is nothing to guess a dictionary for.
* A presented key is hashed and compared with **every** stored hash using
  :func:`hmac.compare_digest`, without stopping at a match: the time taken does not
  depend on which key, or how much of one, matched.
* A key comes in ``Authorization: Bearer <key>``, or in ``x-api-key: <key>``, the header Anthropic's
  clients send theirs in (:data:`API_KEY_HEADER`). A request may carry both only if they hold the same
  key, and neither twice: a proxy that adds one must not change who the caller is.
* A key proves one of three identities: a tenant (submits as it, reads its status), the admin
  (reads everything, submits nothing) or a metrics scraper (:data:`METRICS_READER`: reads
  ``/metrics`` and ``/metrics.json`` and nothing else, so a Prometheus server need not hold the
  admin key). A hash may appear once across all of them (the config refuses a repeat).
* No key is configured at all: authentication is off and every caller is
  :data:`OPEN_ACCESS` (the quick start on 127.0.0.1). Then the body's ``tenant_id``
  says who the request is for. :func:`check_exposure` refuses to listen beyond
  loopback in that state, and :func:`cross_site_refusal` keeps browsers from acting for
  pages of other origins (a cross-site form, a DNS-rebinding page).
* Keys and hashes never appear in logs or in answers.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from typing import Protocol

import attrs

from apsd.core.config import KEY_HASH_PATTERN, Config, ConfigError
from apsd.core.keys import MIN_KEY_CHARS, TOKEN, hash_key, is_usable_key, new_key
from apsd.core.models import Refusal

__all__ = ["API_KEY_HEADER", "Caller", "HeaderFields", "KeyRing", "METRICS_READER", "OPEN_ACCESS", "check_exposure", "cross_site_refusal", "hash_key",
           "is_allowed_host", "is_loopback",
           "is_usable_key", "new_key", "KEY_HASH_PATTERN", "MIN_KEY_CHARS"]

_TOKEN = TOKEN
_BEARER = re.compile(rf"[Bb][Ee][Aa][Rr][Ee][Rr] +({_TOKEN}) *")
_KEY = re.compile(rf" *({_TOKEN}) *")
_CHALLENGE = 'Bearer realm="apsd"'
#: The header that carries a key the way Anthropic's clients send it (``ANTHROPIC_API_KEY``).
API_KEY_HEADER = "x-api-key"


@attrs.frozen
class Caller:
    """Who a request comes from: a tenant (by key), the operator (admin key), a metrics scraper
    (metrics key), or anyone (keys off)."""

    tenant: str | None
    admin: bool = False
    #: Authentication is off: the caller is whoever the request says (loopback only).
    anonymous: bool = False
    #: A metrics key: may read ``/metrics`` and ``/metrics.json``, and nothing else.
    metrics_only: bool = False
    #: Who this is in the audit log: ``admin:<name>`` for a named admin key (``[auth.admin_keys]``),
    #: ``admin:<the first 8 hex digits of its key's hash>`` for another admin key (which key, never the
    #: key), ``admin:open`` without keys; None for the others.
    actor: str | None = None
    #: The issued key a tenant's request came with (``/admin``: its id), which its usage and limits
    #: are counted under; None: a key from the config file, or no key.
    key_id: str | None = None

    def may_read_tenant(self, tenant_id: str) -> bool:
        return self.admin or self.anonymous or self.tenant == tenant_id

    def may_read_metrics(self) -> bool:
        return self.admin or self.anonymous or self.metrics_only


#: The caller when no key is configured: may do everything, as whichever tenant the body names.
OPEN_ACCESS = Caller(tenant=None, admin=True, anonymous=True, actor="admin:open")
#: The caller a metrics key proves: no tenant, not the admin; reads the metrics only.
METRICS_READER = Caller(tenant=None, metrics_only=True)


def _unauthorized(error: str, message: str, challenge: str = _CHALLENGE) -> Refusal:
    return Refusal(401, error, message, headers={"WWW-Authenticate": challenge})


@attrs.frozen
class KeyRing:
    """The configured keys, as SHA-256 digests, each with the :class:`Caller` it proves."""

    entries: tuple[tuple[bytes, Caller], ...] = ()
    #: The metrics keys' digests (also in ``entries``): what :meth:`is_metrics_key` compares with.
    metrics_digests: tuple[bytes, ...] = ()

    @classmethod
    def from_config(cls, config: Config) -> KeyRing:
        issued = {key.key_hash: key.key_id for key in config.keys.values()}
        entries = [(_digest(h), Caller(tenant=name, key_id=issued.get(h)))
                   for name, tenant in sorted(config.tenants.items()) for h in tenant.api_key_hashes]
        entries += [(_digest(h), Caller(tenant=None, admin=True, actor=f"admin:{h[7:15]}"))
                    for h in config.auth.admin_key_hashes]
        entries += [(_digest(h), Caller(tenant=None, admin=True, actor=f"admin:{name}"))
                    for name, h in sorted(config.auth.admin_keys.items())]
        metrics = tuple(_digest(h) for h in config.auth.metrics_key_hashes)
        entries += [(digest, METRICS_READER) for digest in metrics]
        return cls(tuple(entries), metrics)

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    def identify_headers(self, values: list[str], api_keys: list[str] | None = None) -> Caller | Refusal:
        """:meth:`identify` for every ``Authorization`` header (``values``) and ``x-api-key`` header
        (``api_keys``) of a request: more than one of either is refused, and so are both naming different
        keys (a proxy that appends one, or picks the last, must not change who the caller is)."""
        if not self.enabled:
            return OPEN_ACCESS
        authorization = _authorization(values, api_keys or [])
        return authorization if isinstance(authorization, Refusal) else self.identify(authorization)

    def identify(self, authorization: str | None) -> Caller | Refusal:
        """The caller an ``Authorization`` header value proves, or the 401 to answer."""
        if not self.enabled:
            return OPEN_ACCESS
        if not authorization:
            return _unauthorized("missing_api_key", "this endpoint needs an API key: "
                                 f"send 'Authorization: Bearer <key>' (or '{API_KEY_HEADER}: <key>')")
        match = _BEARER.fullmatch(authorization)
        if match is None:
            return _unauthorized("invalid_authorization", "the Authorization header must be 'Bearer <key>'",
                                 f'{_CHALLENGE}, error="invalid_request"')
        digest = hashlib.sha256(match.group(1).encode("ascii")).digest()
        found: Caller | None = None
        for stored, caller in self.entries:  # every entry, every time: no early exit
            if hmac.compare_digest(stored, digest):
                found = caller
        if found is None:
            return _unauthorized("invalid_api_key", "the API key is not valid",
                                 f'{_CHALLENGE}, error="invalid_token"')
        return found

    def is_metrics_key(self, values: list[str], api_keys: list[str] | None = None) -> bool:
        """Whether a request's ``Authorization`` and ``x-api-key`` headers present exactly one key, a
        valid metrics key.

        Compares with the metrics keys only (every one, no early exit), so the HTTP layer can keep
        such a key to the metrics endpoints without identifying every request twice over the whole ring.
        """
        if not self.metrics_digests:
            return False
        authorization = _authorization(values, api_keys or [])
        if not isinstance(authorization, str) or (match := _BEARER.fullmatch(authorization)) is None:
            return False
        digest = hashlib.sha256(match.group(1).encode("ascii")).digest()
        found = False
        for stored in self.metrics_digests:
            found |= hmac.compare_digest(stored, digest)
        return found


def _authorization(values: list[str], api_keys: list[str]) -> str | None | Refusal:
    """The ``Authorization`` value a request's headers amount to (an ``x-api-key`` as ``Bearer <key>``),
    None for no key, or the 401 for headers that do not name one key."""
    invalid = f'{_CHALLENGE}, error="invalid_request"'
    if len(values) > 1:
        return _unauthorized("invalid_authorization", "more than one Authorization header", invalid)
    if not api_keys:
        return values[0] if values else None
    if len(api_keys) > 1:
        return _unauthorized("invalid_authorization", f"more than one {API_KEY_HEADER} header", invalid)
    match = _KEY.fullmatch(api_keys[0])
    if match is None:
        return _unauthorized("invalid_authorization", f"the {API_KEY_HEADER} header must be one key", invalid)
    if values:
        bearer = _BEARER.fullmatch(values[0])
        if bearer is None or bearer.group(1) != match.group(1):
            return _unauthorized("invalid_authorization", f"Authorization and {API_KEY_HEADER} name different "
                                 "keys; send one", invalid)
    return f"Bearer {match.group(1)}"


def _digest(stored_hash: str) -> bytes:
    return bytes.fromhex(stored_hash.removeprefix("sha256:"))


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` is reachable only from this machine."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: it may resolve to anything


#: Methods that change nothing: a cross-site page may send them (it cannot read the answer once the
#: Host is checked).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _hostname(authority: str) -> str:
    """The host of a ``Host`` header or an origin's authority, without its port, lower case."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1:authority.find("]")] if "]" in authority else authority
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


def is_allowed_host(authority: str, listen_host: str) -> bool:
    """Whether a request's ``Host`` names this daemon as only a local client would: a loopback name
    or address, or the configured listen address. A page whose own domain resolves to 127.0.0.1
    (DNS rebinding) sends its own domain, and is refused."""
    host = _hostname(authority)
    if not host:
        return True  # (no Host: HTTP/1.0; browsers always send one)
    return host == _hostname(listen_host) or host.endswith(".localhost") or is_loopback(host)


class HeaderFields(Protocol):
    """A request's header fields as both werkzeug's ``Headers`` (the Quart app's) and the data plane's
    (:class:`apsd.serve.http.exchange.Headers`) give them: by name, in any case."""

    def get(self, name: str, /) -> str | None: ...

    def getlist(self, name: str, /) -> list[str]: ...


def cross_site_refusal(method: str, headers: HeaderFields, listen_host: str) -> Refusal | None:
    """Without API keys anyone who reaches apsd may act as the admin and as any tenant, so a browser
    must not be made to act for a page from elsewhere (the daemon runs on the operator's machine):
    403 ``host_not_allowed`` for a ``Host`` that is not this daemon's own (:func:`is_allowed_host`),
    and, for a method that changes something, 403 ``cross_site_request`` when the browser says the
    request comes from another origin (``Sec-Fetch-Site`` other than ``same-origin``/``none``, or an
    ``Origin`` other than the ``Host`` it was sent to). Clients that are not browsers send neither
    header and pass. (With keys, a cross-site page cannot send ``Authorization`` without a CORS
    preflight, which apsd never grants.)"""
    host = headers.get("Host") or ""
    if not is_allowed_host(host, listen_host):
        return Refusal(403, "host_not_allowed", f"without API keys apsd answers only requests addressed to it by a "
                       f"loopback name or its listen address, not {host[:100]!r} (a DNS-rebinding page?)")
    if method.upper() in SAFE_METHODS:
        return None
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site.strip().lower() not in ("same-origin", "none"):
        return Refusal(403, "cross_site_request", f"a cross-site request ({site[:40]}) cannot change anything: "
                       "without API keys apsd accepts only same-origin requests from a browser")
    origin = headers.get("Origin")
    if origin is not None:
        authority = origin.strip().lower().split("://", 1)[-1].rstrip("/")
        if origin.strip().lower() == "null" or authority != host.strip().lower():
            return Refusal(403, "cross_site_request", f"a request from another origin ({origin[:100]}) cannot "
                           "change anything: without API keys apsd accepts only same-origin requests from a browser")
    return None


def check_exposure(config: Config) -> None:
    """Refuse (ConfigError) to listen beyond loopback when no API key is configured."""
    if is_loopback(config.server.host) or KeyRing.from_config(config).enabled:
        return
    raise ConfigError(
        f"{config.source}: server.host: refusing to listen on {config.server.host!r} without API keys: "
        "anyone who can reach it could use any tenant's quota. Give each tenant "
        "api_key_hashes (make a key with 'apsd hash-key --new'), or listen on 127.0.0.1")
