"""API keys as values: what one looks like, how a new one is made, and the hash apsd keeps.

Who a key identifies, and how a request's key is checked, is :mod:`apsd.serve.auth`'s.
"""

from __future__ import annotations

import hashlib
import re
import secrets

__all__ = ["MIN_KEY_CHARS", "TOKEN", "hash_key", "is_usable_key", "new_key"]

#: Shortest key ``apsd hash-key`` accepts: a key is a secret token, not a password.
MIN_KEY_CHARS = 24
#: The bearer token grammar of RFC 6750 section 2.1 (b64token): what a key may consist of.
TOKEN = r"[A-Za-z0-9\-._~+/]+=*"


def hash_key(key: str) -> str:
    """The ``sha256:<hex>`` form the config stores for ``key``."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def is_usable_key(key: str) -> bool:
    """Whether ``key`` can be an API key: a bearer token of at least :data:`MIN_KEY_CHARS` characters."""
    return len(key) >= MIN_KEY_CHARS and re.fullmatch(TOKEN, key) is not None


def new_key() -> str:
    """A fresh random key (256 bits, URL-safe; the ``apsd_`` prefix makes leaked keys easy to grep for)."""
    return "apsd_" + secrets.token_urlsafe(32)
