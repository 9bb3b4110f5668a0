"""Configuration: the TOML file parsed once into frozen attrs values.

Ownership: :func:`load_config` reads the file and is the only place raw TOML
is trusted; everything downstream receives validated :class:`Config` objects.
Errors are :class:`ConfigError` with one message naming the file and the key
(``config/apsd.toml: tenants.tenant_a.rate: must be > 0, got -5``).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs

__all__ = [
    "ANY_MODEL",
    "AlertsConfig",
    "AuthConfig",
    "Config",
    "ConfigError",
    "BackendConfig",
    "EngineConfig",
    "GatewayConfig",
    "ForwardConfig",
    "GpuConfig",
    "KeyConfig",
    "KeyLimits",
    "PriceConfig",
    "PolicyConfig",
    "QueueConfig",
    "ServerConfig",
    "ServiceClassConfig",
    "StateConfig",
    "TenantConfig",
    "TracingConfig",
    "load_config",
    "field_comments",
    "parse_section",
]


def field_comments(cls: type) -> dict[str, str]:
    """The ``#:`` comment block right above each field of class ``cls``, as one line per field."""
    lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    classdef = ast.parse("\n".join(lines)).body[0]
    assert isinstance(classdef, ast.ClassDef)
    comments: dict[str, str] = {}
    for node in classdef.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            block: list[str] = []
            above = node.lineno - 2  # (0-based index of the line above the field)
            while above >= 0 and lines[above].strip().startswith("#:"):
                block.insert(0, lines[above].strip()[2:].strip())
                above -= 1
            if block:
                comments[node.target.id] = " ".join(block)
    return comments


class ConfigError(Exception):
    """A configuration problem; ``str()`` names the source and the key."""


def between(low: float, high: float) -> Callable[[object, attrs.Attribute[Any], float], None]:
    """A validator for ``low <= value <= high`` (the ranges keep later arithmetic finite)."""
    def check(_inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
        if not low <= value <= high:
            raise ValueError(f"must be between {low:g} and {high:g}, got {value!r}")
    return check


def off_or_between(low: float, high: float) -> Callable[[object, attrs.Attribute[Any], float], None]:
    """A validator for ``0`` (the feature is off) or ``low <= value <= high``."""
    def check(_inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
        if value != 0 and not low <= value <= high:
            raise ValueError(f"must be 0 (off) or between {low:g} and {high:g}, got {value!r}")
    return check


def non_empty(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not value.strip():
        raise ValueError("must not be empty")


#: What a stored API key hash looks like: ``sha256:`` and 64 lower-case hex digits (see apsd.serve.auth).
KEY_HASH_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")


_KEY_HASHES_RULE = "must be an array of 'sha256:<64 hex digits>' strings, as 'apsd hash-key' prints"


def key_hashes(_inst: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    # (never echo the value: a key pasted where its hash belongs must not reach a terminal or the log)
    for i, item in enumerate(value):
        if not KEY_HASH_PATTERN.fullmatch(item):
            raise ValueError(f"{_KEY_HASHES_RULE}; entry [{i}] ({len(item)} characters, not shown) is not one")
    if len(set(value)) != len(value):
        raise ValueError("the same key hash is listed twice")


#: Field metadata for values that may hold a secret (by mistake, or by design): errors never show
#: them, and say the rule instead.
SECRET = {"secret": _KEY_HASHES_RULE}
SECRET_STRING = {"secret": "must be a string"}
SECRET_NAMED = {"secret": "must be a table of names and 'sha256:<64 hex digits>' strings (alice = \"sha256:...\"), "
                          "as 'apsd hash-key' prints them"}


#: A name a key may have (an admin key's in ``[auth.admin_keys]``; an issued key's, through ``/admin``).
KEY_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def named_key_hashes(_inst: object, attribute: attrs.Attribute[Any], value: dict[str, str]) -> None:
    for name, item in value.items():
        if not KEY_NAME_PATTERN.fullmatch(name):
            raise ValueError(f"{name[:70]!r}: a key's name is 1-64 letters, digits and '.', '_', '@' or '-', "
                             "starting with a letter or digit")
        if not isinstance(item, str) or not KEY_HASH_PATTERN.fullmatch(item):
            raise ValueError(f"{name}: must be 'sha256:<64 hex digits>', as 'apsd hash-key' prints (the value given "
                             "is not shown)")
    if len(set(value.values())) != len(value):
        raise ValueError("the same key hash is listed twice")


def either(first: str, second: str) -> Callable[[object, attrs.Attribute[Any], str], None]:
    """A validator: the value is ``first`` or ``second``."""
    def check(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in (first, second):
            raise ValueError(f"must be \"{first}\" or \"{second}\", got {value!r}")
    return check


def one_of(*choices: str) -> Callable[[object, attrs.Attribute[Any], str], None]:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")
    return check


def model_names(_inst: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for i, item in enumerate(value):
        if not item.strip():
            raise ValueError(f"entry [{i}] is empty: a model name is needed")
    if len(set(value)) != len(value):
        raise ValueError("the same model is listed twice")


def class_names(_inst: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for i, item in enumerate(value):
        if not item.strip():
            raise ValueError(f"entry [{i}] is empty: a class name is needed")
    if len(set(value)) != len(value):
        raise ValueError("the same class is listed twice")


def strings(value: Iterable[str]) -> tuple[str, ...]:
    """A converter: the strings as a tuple (a TOML array arrives as a list). The validators check the items."""
    return tuple(value)


def numbers(value: Iterable[float]) -> tuple[float, ...]:
    """A converter: the numbers as a tuple (a TOML array arrives as a list). The validators check the items."""
    return tuple(value)


def port_number(_inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError(f"must be a port number 0-65535, got {value!r}")


@attrs.frozen
class ServerConfig:
    """Where the HTTP API listens and how it shuts down."""

    #: Listen address (``--host`` overrides it). Anything but a loopback address (127.0.0.0/8,
    #: ``::1``, ``localhost``) needs API keys: without any, apsd refuses to start.
    host: str = attrs.field(default="127.0.0.1", validator=non_empty)
    #: Listen port; 0 picks a free port (``--port`` overrides it).
    port: int = attrs.field(default=8002, validator=port_number)
    #: Wall seconds queued and running requests get to finish after SIGTERM/SIGINT (a second
    #: signal ends the wait).
    shutdown_grace_s: float = attrs.field(default=30.0, validator=between(0, 86_400))
    #: Largest accepted request body; larger bodies get 413.
    max_body_bytes: int = attrs.field(default=1_048_576, validator=between(1, 1 << 30))
    #: Wall seconds a connection may sit idle (before its first request, or between two) before
    #: apsd closes it: idle clients must not hold file descriptors others need. A request whose
    #: first bytes arrived by then is answered; it gets this long again for its head
    #: (:mod:`apsd.serve.server`).
    keep_alive_timeout_s: float = attrs.field(default=5.0, validator=between(0.01, 3600))
    #: Wall seconds a request body has to arrive in full once its headers have; a slower one is
    #: answered 408 ``request_timeout`` and its connection closed.
    body_timeout_s: float = attrs.field(default=10.0, validator=between(0.01, 3600))
    #: Wall seconds a client may take nothing of its answer while apsd has more to write (a stream
    #: reader that stopped reading) before apsd drops its connection, with a reset; its request is
    #: cancelled, charged what its engine did. One that keeps reading, however slowly, is not
    #: dropped (:mod:`apsd.serve.server`).
    send_timeout_s: float = attrs.field(default=60.0, validator=between(0.01, 3600))
    #: Connections the kernel queues for apsd to accept (the listen backlog; the kernel caps it
    #: at ``net.core.somaxconn``).
    backlog: int = attrs.field(default=2048, validator=between(1, 65535))
    #: Listen with SO_REUSEPORT, so that several replicas on one machine share one port (the
    #: kernel spreads new connections between them).
    reuse_port: bool = False


@attrs.frozen
class TenantConfig:
    """One tenant's token bucket: ``rate`` tokens/second, at most ``burst`` banked."""

    #: Tokens per (model) second added to the tenant's bucket; with replicas sharing a store, its
    #: total across them.
    rate: float = attrs.field(validator=between(1e-6, 1e12))
    #: The most tokens its bucket holds, which it starts with. A request that costs more is refused
    #: 413 ``exceeds_tenant_burst``.
    burst: int = attrs.field(validator=between(1, 10**12))
    #: Hashes of this tenant's API keys (several, so a key can be rotated without downtime).
    api_key_hashes: tuple[str, ...] = attrs.field(default=(), converter=strings, validator=key_hashes,
                                                  metadata=SECRET)
    #: The highest bid its requests get (1-10): a higher ``priority_bid``, ``X-Apsd-Priority`` or
    #: vLLM ``priority`` is served at this bid (clamped, not refused).
    max_bid: int = attrs.field(default=10, validator=between(1, 10))  # (MAX_BID)
    #: The bid of an OpenAI-API request that asks for no priority (vLLM ``priority`` 0);
    #: ``priority`` p asks for ``default_bid - p``. At most ``max_bid``.
    default_bid: int = attrs.field(default=5, validator=between(1, 10))
    #: Its share under fair-share policies (``fair``, ``vtc``): a tenant of weight 2 is given twice
    #: the service of a tenant of weight 1 while both are backlogged.
    weight: float = attrs.field(default=1.0, validator=between(1e-3, 1e6))
    #: The models its requests may name (the OpenAI ``model``); empty: every model. Another is
    #: refused 403 ``model_not_allowed``.
    models: tuple[str, ...] = attrs.field(default=(), converter=strings, validator=model_names)
    #: Tokens (prompt + output) it may use per ``budget_period``, across replicas; 0: no budget.
    #: Admission reserves a request's whole cost against it and settles what the request used, as
    #: for the bucket: a request that would pass it is refused 429 ``budget_exhausted``.
    budget_tokens: int = attrs.field(default=0, validator=between(0, 10**15))
    #: US dollars it may spend per ``budget_period``, across replicas, at the ``[prices]`` of the models it
    #: uses; 0: no dollar budget. Held like ``budget_tokens`` (both may be set): a request that would pass
    #: it is refused 429 ``budget_exhausted``, and one for a model without a price 403 ``model_not_priced``.
    budget_usd: float = attrs.field(default=0.0, validator=between(0, 1e12))
    #: ``day`` or ``month``, in UTC: when the budget starts again.
    budget_period: str = attrs.field(default="day", validator=either("day", "month"))
    #: Output tokens a request reserves at most in its bucket and budgets (it reserves the smaller of this
    #: and its ``max_tokens``; what it generates beyond is settled as debt); 0: learned from the tenant's
    #: recent outputs (``[admission] output_estimate_percentile``).
    output_estimate_tokens: int = attrs.field(default=0, validator=between(0, 10**9))
    #: The largest request (prompt estimate + output limit) it may send; a larger one is refused 413
    #: ``exceeds_max_request_tokens``. 0: no limit of its own (a request whose prompt alone passes its
    #: ``burst`` is refused all the same).
    max_request_tokens: int = attrs.field(default=0, validator=between(0, 10**12))
    #: Its requests in flight at once (queued for dispatch or running); beyond, a request waits in
    #: arrival order behind the tenant's others until one ends. 0: no limit.
    max_concurrency: int = attrs.field(default=0, validator=between(0, 10**6))
    #: A disabled tenant's new requests are refused 403 ``tenant_disabled``; those already queued or
    #: running finish. Its keys and counters are kept.
    disabled: bool = False
    #: The service classes (``[classes.<name>]``) its requests may name (``X-Apsd-Class`` or
    #: ``service_class``); empty: none. Another is refused 403 ``class_not_allowed``.
    classes: tuple[str, ...] = attrs.field(default=(), converter=strings, validator=class_names)
    #: The class of its requests that name none (one of its ``classes``); empty: such requests have
    #: no class (no deadline).
    default_class: str = ""

    def __attrs_post_init__(self) -> None:
        if self.default_bid > self.max_bid:
            raise ValueError(f"default_bid: must be <= max_bid ({self.max_bid}), got {self.default_bid}")
        if self.default_class and self.default_class not in self.classes:
            raise ValueError(f"default_class: must be one of its classes ({', '.join(self.classes) or 'none'}), "
                             f"got {self.default_class!r}")


#: Bids run from 1 to this; a request that asks for no bid on the OpenAI API gets ``DEFAULT_BID``
#: (both also the defaults of a tenant's ``max_bid`` and ``default_bid``).
MAX_BID = 10
DEFAULT_BID = 5


def clamp_bid(tenant: TenantConfig | None, wanted: int) -> int:
    """The bid a request asking for ``wanted`` is served at: 1 to its tenant's ``max_bid``, clamped,
    not refused (``None``, a tenant admission will answer 404: 1 to :data:`MAX_BID`). The one rule
    behind ``/infer``'s ``priority_bid`` and the OpenAI API's ``priority`` and ``X-Apsd-Priority``."""
    return max(1, min(wanted, MAX_BID if tenant is None else tenant.max_bid))


@attrs.frozen
class AuthConfig:
    """Operator access: keys for the operator-only endpoints (``/metrics``, any tenant's status),
    and keys that may only scrape ``/metrics`` (a Prometheus server's).

    Authentication is on as soon as any key (a tenant's, an admin's or a metrics key) is configured.
    """

    #: Hashes (``apsd hash-key``) of the operator's keys: they read ``/metrics``, ``/metrics.json``
    #: and any tenant's status, and cannot submit requests.
    admin_key_hashes: tuple[str, ...] = attrs.field(default=(), converter=strings, validator=key_hashes,
                                                    metadata=SECRET)
    #: Keys that read ``/metrics`` and ``/metrics.json`` and nothing else (403 ``metrics_only``
    #: everywhere else): what a scraper holds instead of the admin key.
    metrics_key_hashes: tuple[str, ...] = attrs.field(default=(), converter=strings, validator=key_hashes,
                                                      metadata=SECRET)
    #: Named operator keys (``[auth.admin_keys]``: ``alice = "sha256:..."``): the same rights as
    #: ``admin_key_hashes``, and the audit log names the change's author ``admin:alice`` rather than by
    #: the first digits of the hash. A name is 1-64 letters, digits and ``.``, ``_``, ``@`` or ``-``.
    admin_keys: dict[str, str] = attrs.field(factory=dict, validator=named_key_hashes, metadata=SECRET_NAMED)

    def admin_hashes(self) -> tuple[str, ...]:
        """Every admin key's hash, named or not."""
        return (*self.admin_key_hashes, *self.admin_keys.values())


@attrs.frozen
class QueueConfig:
    """Backpressure: admitted-but-not-dispatched requests beyond this get 503."""

    #: Admitted requests not yet dispatched, all tenants together: beyond it new requests get 503
    #: ``queue_full``.
    max_requests: int = attrs.field(default=10_000, validator=between(1, 10**8))
    #: One tenant's share of the queue: beyond it that tenant gets 429 (the others are unaffected).
    max_requests_per_tenant: int = attrs.field(default=2_000, validator=between(1, 10**8))
    #: Most tokens (prompt + requested, summed) the queue may hold: bounds the prompt text kept in
    #: memory too (about ``max_tokens * chars_per_token`` characters at worst). Beyond it, 503.
    max_tokens: int = attrs.field(default=10_000_000, validator=between(1, 10**15))
    #: Requests waiting in the ingress channel for the admission task.
    ingress_buffer: int = attrs.field(default=1_024, validator=between(1, 10**7))
    #: Longest a request may wait in the queue, in model seconds (counted from its arrival);
    #: one still queued then is answered 504 ``queue_timeout`` and its tokens are refunded.
    #: A request's own ``timeout_s`` may shorten it, never lengthen it. 0 (the default) is no
    #: limit: the simulator's overload workloads queue for far longer than any sane timeout.
    timeout_s: float = attrs.field(default=0.0, validator=off_or_between(0.001, 86_400))


@attrs.frozen
class AdmissionConfig:
    """How a prompt's token count is estimated (there is no tokenizer): conservatively, so that a
    backend never counts far more (docs/reference/accounting.md).

    Every ASCII character that is not a letter (digits, punctuation, symbols, whitespace but a space
    that begins a word) counts as one token."""

    #: ASCII letters per token of a prompt's estimate (English text: about 4) ...
    chars_per_token: float = attrs.field(default=4.0, validator=between(0.1, 1000))
    #: ... and UTF-8 bytes per token for the rest of it (CJK, emoji, accents): 1 (the default) is
    #: what a byte-level tokenizer can spend at worst, so the estimate does not undercount them (a
    #: real tokenizer's count, the backend's usage, settles the difference).
    non_ascii_bytes_per_token: float = attrs.field(default=1.0, validator=between(0.1, 1000))
    #: Longest prompt, in estimated tokens: a longer one gets 413 ``prompt_too_long``.
    max_prompt_tokens: int = attrs.field(default=32_768, validator=between(1, 10**9))
    #: The share of a cached prompt token's charge a tenant is spared when its engine found the
    #: token in its prefix cache (a backend's ``usage.prompt_tokens_details.cached_tokens``, or the
    #: continuous engine's own cache): 0 charges cached tokens in full, 0.5 at half, 1 not at all.
    cached_prompt_discount: float = attrs.field(default=0.0, validator=between(0.0, 1.0))
    #: Output tokens a request reserves (at most its ``max_tokens``) before its tenant has
    #: ``OUTPUT_ESTIMATE_MIN_SAMPLES`` completed requests to learn from, when the tenant sets no
    #: ``output_estimate_tokens`` of its own.
    output_estimate_default: int = attrs.field(default=1024, validator=between(1, 10**9))
    #: The percentile of a tenant's recent output lengths (completed requests) that its requests
    #: reserve once learned: a higher one means less debt, a lower one fewer tokens held.
    output_estimate_percentile: float = attrs.field(default=90.0, validator=between(1.0, 100.0))
    #: How many of a tenant's latest completed requests the learned estimate reads.
    output_estimate_window: int = attrs.field(default=200, validator=between(1, 100_000))


def redis_url(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value and not re.fullmatch(r"(redis|rediss|unix)://\S+", value):
        raise ValueError(f"must be a redis://, rediss:// or unix:// URL, got {value!r}")


@attrs.frozen
class StoreConfig:
    """Where tenants' buckets and fair-share counters live: this process (``memory``), or Redis,
    shared by every replica (``redis``: :mod:`apsd.store`)."""

    #: ``memory``: this process's own buckets (their levels kept in ``[state]`` across restarts);
    #: ``redis``: shared by every replica through Redis, where they outlive a replica's restart.
    kind: str = attrs.field(default="memory", validator=either("memory", "redis"))
    #: The Redis server (``redis://host:6379/0``); required with ``kind = "redis"``.
    url: str = attrs.field(default="", validator=redis_url)
    #: When Redis cannot be reached: ``local`` keeps admitting on this replica's share of each
    #: tenant's rate; ``refuse`` answers 503 ``store_unavailable``. Either way it is logged and
    #: exported, and the store reconnects by itself.
    on_unavailable: str = attrs.field(default="local", validator=either("local", "refuse"))
    #: Wall seconds between two exchanges with Redis: leases topped up and returned, fair-share
    #: counters pushed and pulled. Shorter: closer to exact, more Redis traffic.
    sync_interval_s: float = attrs.field(default=0.05, validator=between(0.001, 60))
    #: Prefix of every key apsd writes (several deployments may share one Redis).
    key_prefix: str = attrs.field(default="apsd", validator=non_empty)

    @property
    def shared(self) -> bool:
        """Replicas share this store (every kind but ``memory``)."""
        return self.kind != "memory"


#: Where the state file lives when ``[state] path`` is empty: systemd's ``StateDirectory=``, else
#: the XDG state directory (see :meth:`StateConfig.sqlite_path`).
STATE_FILE_NAME = "apsd.db"


@attrs.frozen
class StateConfig:
    """What apsd keeps across restarts, and where: tenants and keys managed through ``/admin``, the
    audit log, tenants' bucket levels, budgets' spend and usage history (:mod:`apsd.state`)."""

    #: ``auto``: an embedded SQLite file for a single daemon, Redis (``[store]``'s) when replicas
    #: share a store; ``sqlite`` or ``redis`` to say so; ``off``: nothing is kept (the admin API then
    #: refuses changes, and a restart starts from the file alone).
    kind: str = attrs.field(default="auto", validator=one_of("auto", "sqlite", "redis", "off"))
    #: The SQLite file; empty: ``$STATE_DIRECTORY/apsd.db`` under systemd, else
    #: ``$XDG_STATE_HOME/apsd/apsd.db`` (``~/.local/state/apsd/apsd.db``).
    path: str = ""
    #: Wall seconds between two writes of usage, bucket levels and budget spend: a ``kill -9`` loses
    #: at most this much of them (changes through ``/admin`` are written at once).
    flush_interval_s: float = attrs.field(default=5.0, validator=between(0.05, 3600))
    #: Wall seconds between two looks for changes another replica made through its ``/admin``.
    poll_interval_s: float = attrs.field(default=1.0, validator=between(0.05, 3600))
    #: Days of hourly usage kept; older hours are deleted (0: kept forever).
    usage_retention_days: int = attrs.field(default=400, validator=between(0, 100_000))
    #: Days of audit log kept (0: kept forever).
    audit_retention_days: int = attrs.field(default=0, validator=between(0, 100_000))
    #: Who wins for a tenant the config file declares. ``seed``: the latest change wins: the file's
    #: declaration is applied when it is new or differs from the one last applied, and a change made
    #: through ``/admin`` stays until the file's declaration of that tenant changes. ``authoritative``:
    #: the file always wins, and ``/admin`` refuses to change or delete the tenants it declares (it
    #: may still issue and revoke their keys): for a file kept in git.
    file_tenants: str = attrs.field(default="seed", validator=either("seed", "authoritative"))

    def sqlite_path(self, environ: Mapping[str, str]) -> Path:
        """The SQLite file this config names, given the process's environment."""
        if self.path:
            return Path(self.path).expanduser()
        if environ.get("STATE_DIRECTORY"):  # (systemd may list several, ':'-separated: the first)
            return Path(environ["STATE_DIRECTORY"].split(":")[0]) / STATE_FILE_NAME
        base = environ.get("XDG_STATE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".local" / "state")
        return Path(base) / "apsd" / STATE_FILE_NAME


@attrs.frozen
class GatewayConfig:
    """The OpenAI-compatible API (``/v1``)."""

    #: Output tokens a request that sets neither ``max_tokens`` nor ``max_completion_tokens`` may
    #: generate: what admission reserves for it, and what a simulated engine generates.
    default_max_tokens: int = attrs.field(default=256, validator=between(1, 1_000_000_000))


#: The batch engine's KV cache, in tokens (prompt + requested, summed over one batch).
SEED_KV_CAP_TOKENS = 32_768


@attrs.frozen
class GpuConfig:
    """The simulated GPU the ``batch`` engine runs (every constant of its model is here; the
    defaults approximate an A100), the model clock of every simulated engine, and the batch
    engine's fault injection."""

    #: Prefill speed, in tokens per second over a batch's prompt tokens.
    prefill_tokens_per_s: float = attrs.field(default=1024.0, validator=between(1e-3, 1e12))
    #: Single-sequence decode speed; a batch of b decodes at
    #: ``decode_tokens_per_s * (decode_batch_base + decode_batch_sqrt * sqrt(b))``.
    decode_tokens_per_s: float = attrs.field(default=128.0, validator=between(1e-3, 1e12))
    #: The constant term of the batch decode rate (see ``decode_tokens_per_s``).
    decode_batch_base: float = attrs.field(default=0.4, validator=between(0, 1e6))
    #: The ``sqrt(b)`` term of the batch decode rate (see ``decode_tokens_per_s``);
    #: ``decode_batch_base + decode_batch_sqrt`` must be above 0.
    decode_batch_sqrt: float = attrs.field(default=0.6, validator=between(0, 1e6))
    #: USD per hour of the simulated GPU's busy time: what its batches cost.
    price_per_hour_usd: float = attrs.field(default=3.0, validator=between(0, 1e9))
    #: KV cache of one batch: the prompt + requested tokens of its requests, summed; a request
    #: alone above it is refused 413 ``exceeds_batch_capacity``.
    kv_cap_tokens: int = attrs.field(default=SEED_KV_CAP_TOKENS, validator=between(1, 10**12))
    #: Wall seconds per model second: 1.0 is real time, 0.01 runs 100x faster.
    #: Every duration apsd reports is in model seconds, whatever this is.
    time_scale: float = attrs.field(default=1.0, validator=between(1e-6, 1e6))
    #: Fault injection (see :class:`apsd.engines.batch.FaultInjector`): each batch fails with this
    #: probability, drawn from a ``random.Random(fault_seed)`` the pipeline owns ...
    fail_probability: float = attrs.field(default=0.0, validator=between(0, 1))
    #: ... and every n-th batch the pipeline's GPUs start fails (0: never).
    fail_every_n_batches: int = attrs.field(default=0, validator=between(0, 10**9))
    #: Seed of the fault injector's own random generator: the same seed fails the same batches.
    fault_seed: int = attrs.field(default=0, validator=between(0, 2**63 - 1))


@attrs.frozen
class EngineKind:
    """What the rest of the configuration must know of an engine kind (the engines are in
    ``apsd/engines/``; they describe themselves once built: :func:`apsd.engines.describe`)."""

    #: Runs in model time, which ``[gpu] time_scale`` may speed up (False: real servers, real time).
    simulated: bool
    #: Relays to the servers of ``[[backends]]``, and is chosen by their presence.
    forwards: bool
    #: Forms its own batches as requests come (iteration-level batching, or a server that does):
    #: the scheduler waits out no batch window for it unless one is configured
    #: (:meth:`PolicyConfig.window_configured`).
    batches_itself: bool


ENGINE_KINDS: dict[str, EngineKind] = {
    "batch": EngineKind(simulated=True, forwards=False, batches_itself=False),
    "continuous": EngineKind(simulated=True, forwards=False, batches_itself=True),
    "forward": EngineKind(simulated=False, forwards=True, batches_itself=True),
}
#: Kinds that were renamed: a config naming one gets an error that names the new one.
RENAMED_ENGINE_KINDS = {"micro": "batch"}
#: Settings that were removed, and what took their place (the error for one says so).
REPLACED_KEYS = {
    "forward.tenant_active_s": "apsd no longer holds free slots for tenants that were active lately: every free "
                               "slot serves the queue, and a tenant below its share gets a slot by gateway "
                               "preemption ([forward] preempt_min_run_s, max_preemptions)",
    "engine.reserved_sequences": "a continuous engine isolates tenants by their share of it without slots set "
                                 "aside ([engine] isolation, on by default)",
}


def engine_kind(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value in RENAMED_ENGINE_KINDS:
        raise ValueError(f"{value!r} is now called {RENAMED_ENGINE_KINDS[value]!r}")
    if value not in ENGINE_KINDS:
        raise ValueError(f"must be one of {', '.join(ENGINE_KINDS)}, got {value!r}")


@attrs.frozen
class EngineConfig:
    """Where requests run: ``count`` engines of one ``kind`` (see ``apsd/engines/``).

    ``batch`` is a simulated GPU with fixed prefill and decode rates (its constants are under
    ``[gpu]``; the defaults approximate an A100) running whole batches: every request of a batch
    starts and finishes with it. ``continuous`` batches at the
    iteration level on a roofline model of ``gpu`` x ``model`` over ``tp`` GPUs (profiles:
    ``apsd profile --list``). ``forward`` relays to the real servers of ``[[backends]]``
    (chosen by their presence; ``count`` does not apply: one engine routes to them all).
    """

    #: The kind of engine (above); the presence of ``[[backends]]`` makes it the forwarding kind.
    kind: str = attrs.field(default="batch", validator=engine_kind)
    #: Engines of that kind (each a GPU, or ``tp`` GPUs for ``continuous``).
    count: int = attrs.field(default=1, validator=between(1, 1024))
    #: The GPU profile of a continuous engine (``apsd profile --list``; plugins add more).
    gpu: str = attrs.field(default="a100-80gb", validator=non_empty)
    #: The model profile of a continuous engine (``apsd profile --list``; plugins add more).
    model: str = attrs.field(default="llama-3-8b", validator=non_empty)
    #: GPUs per continuous engine, with tensor parallelism; the model must fit on them (an error
    #: names the ``tp`` that fits).
    tp: int = attrs.field(default=1, validator=between(1, 8))
    #: Most sequences one continuous engine runs at once (vLLM's max_num_seqs).
    max_sequences: int = attrs.field(default=256, validator=between(1, 100_000))
    #: Tokens one continuous-engine iteration processes: one per decoding sequence, the rest
    #: prefill chunks (vLLM's max_num_batched_tokens with chunked prefill).
    max_batched_tokens: int = attrs.field(default=8192, validator=between(1, 10**7))
    #: Tenant isolation: on a continuous engine a tenant below its share gets in when the engine is
    #: full (tenants above theirs are preempted), its prompt is prefilled first and the others' in
    #: short chunks; on the forward engine a tenant below its share that finds every slot taken gets
    #: one by gateway preemption of a tenant above its share (docs/explanation/fairness-and-admission.md).
    isolation: bool = True
    #: Prefill tokens per step of tenants at or above their share while isolating; 0 derives it
    #: from the deployment (the smallest chunk about as cheap per token as any: 512 on an A100 for
    #: llama-3-8b).
    prefill_chunk_tokens: int = attrs.field(default=0, validator=between(0, 10**7))
    #: Share of the GPUs' memory for weights and KV cache (vLLM's gpu_memory_utilization).
    memory_fraction: float = attrs.field(default=0.9, validator=between(0.05, 1.0))
    #: USD per GPU-hour; 0 takes the GPU profile's price (continuous; batch uses gpu.price_per_hour_usd).
    price_per_gpu_hour_usd: float = attrs.field(default=0.0, validator=between(0, 1e9))
    #: Times a request whose engine failed before its first token goes back to the queue;
    #: after that it is answered 502.
    max_retries: int = attrs.field(default=0, validator=between(0, 100))
    #: A continuous engine keeps the KV blocks of prompts it has read (vLLM's automatic prefix
    #: caching): a request whose prompt starts with cached blocks skips their prefill.
    prefix_cache: bool = True

    @property
    def simulated(self) -> bool:
        """Runs in model time (``[gpu] time_scale`` applies)."""
        return ENGINE_KINDS[self.kind].simulated

    @property
    def forwards(self) -> bool:
        """Relays to ``[[backends]]``."""
        return ENGINE_KINDS[self.kind].forwards

    @property
    def batches_itself(self) -> bool:
        """Forms its own batches: no batch window unless one is configured."""
        return ENGINE_KINDS[self.kind].batches_itself



def http_url(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not re.fullmatch(r"[!-~]+", value) or not re.fullmatch(r"https?://[^/?#]+(/[^?#]*)?", value):
        raise ValueError(f"must be an http:// or https:// URL of printable ASCII characters, got {value!r}")


def header_safe(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    """A name that apsd sends in response headers (``X-Apsd-Route``) and metrics labels: printable
    ASCII (letters, digits, punctuation, spaces inside), at most 128 characters."""
    if value and (not re.fullmatch(r"[!-~]([ -~]{0,126}[!-~])?", value)):
        raise ValueError("must be 1-128 printable ASCII characters (letters, digits, punctuation, spaces "
                         f"inside): it is sent in response headers and metrics labels; got {value!r}")


@attrs.frozen
class BackendConfig:
    """One OpenAI-compatible inference server the ``forward`` engine relays to (``[[backends]]``)."""

    #: Its base URL, without ``/v1`` (``http://10.0.0.5:8000``).
    url: str = attrs.field(validator=http_url)
    #: A name for logs, metrics and the ``X-Apsd-Route`` header (default: the URL): printable ASCII.
    name: str = attrs.field(default="", validator=header_safe)
    #: Sent as ``Authorization: Bearer`` to the backend. Prefer ``api_key_env``: the config file
    #: is world-readable under systemd.
    api_key: str = attrs.field(default="", metadata=SECRET_STRING, repr=False)
    #: The environment variable holding that key (e.g. set by systemd's ``EnvironmentFile=``).
    api_key_env: str = ""
    #: The models it serves; empty: discovered from its ``/v1/models``.
    models: tuple[str, ...] = attrs.field(default=(), converter=strings)
    #: Requests apsd sends it at once, at most.
    max_concurrency: int = attrs.field(default=8, validator=between(1, 100_000))
    #: Cost, either per GPU-hour of the backend (``gpus`` of them; a request pays its share:
    #: its duration x the backend's hourly price / ``max_concurrency``) ...
    cost_per_gpu_hour_usd: float = attrs.field(default=0.0, validator=between(0, 1e9))
    #: GPUs behind the backend, priced at ``cost_per_gpu_hour_usd`` each.
    gpus: int = attrs.field(default=1, validator=between(1, 1024))
    #: ... or per token: USD per million prompt tokens (both ways may be set: they add up) ...
    cost_per_1m_prompt_tokens_usd: float = attrs.field(default=0.0, validator=between(0, 1e9))
    #: ... and USD per million output tokens (with ``cost_per_1m_prompt_tokens_usd``).
    cost_per_1m_output_tokens_usd: float = attrs.field(default=0.0, validator=between(0, 1e9))
    #: Send each request a ``priority`` for a backend that schedules and preempts by it: ``off``;
    #: ``lower-first`` (vLLM started with ``--scheduling-policy priority``); ``higher-first`` (a server
    #: that runs higher values first). Tenants below their share come first, then higher bids
    #: (docs/how-to/real-servers.md).
    priority: str = attrs.field(default="off", validator=one_of("off", "lower-first", "higher-first"))
    #: What kind of server it is: ``auto`` (found out from its endpoints: ``/props`` is llama.cpp's,
    #: ``/version`` vLLM's, ``/get_server_info`` SGLang's), ``llama.cpp``, ``vllm``, ``sglang``, or
    #: ``openai`` (another OpenAI-compatible server: a preempted chat stream is not resumed on it).
    server: str = attrs.field(default="auto", validator=one_of("auto", "llama.cpp", "vllm", "sglang", "openai"))
    #: ``apsd simulate`` only, in place of the server: model seconds to the first token and per
    #: output token after it, with ``max_concurrency`` requests running at once.
    sim_ttft_s: float = attrs.field(default=0.05, validator=between(0, 3600))
    #: ``apsd simulate`` only: model seconds per output token after the first (see ``sim_ttft_s``).
    sim_tpot_s: float = attrs.field(default=0.02, validator=between(0, 3600))
    #: Tokens of prompts its prefix cache holds, which the ``prefix`` routing policy's picture of it is
    #: sized from; 0 takes ``[routing] cache_tokens``.
    cache_tokens: int = attrs.field(default=0, validator=between(0, 10**10))

    @property
    def label(self) -> str:
        return self.name or self.url


@attrs.frozen
class ForwardConfig:
    """How the ``forward`` engine talks to its backends (wall seconds)."""

    #: Connecting to a backend.
    connect_timeout_s: float = attrs.field(default=5.0, validator=between(0.01, 3600))
    #: A health check, model list or metrics read unanswered within this marks the backend down
    #: (unless it streams to clients meanwhile): a stalled server (stopped, hung) is found out in
    #: seconds, and the requests it holds that have no token yet go back to the queue, to another backend.
    health_timeout_s: float = attrs.field(default=5.0, validator=between(0.01, 3600))
    #: From sending a request to its first token (a non-streamed request: to its whole answer).
    first_token_timeout_s: float = attrs.field(default=120.0, validator=between(0.01, 86_400))
    #: Longest silence between two chunks of a stream (found out within a second after it).
    read_timeout_s: float = attrs.field(default=60.0, validator=between(0.01, 86_400))
    #: Times a request whose backend failed before its first token goes back to the queue (and on
    #: to another backend); then 502 ``backend_failed``.
    max_retries: int = attrs.field(default=2, validator=between(0, 100))
    #: Once no healthy backend has served a model for this long, the requests queued for it are
    #: answered 503 ``no_backend`` (new ones get it at once, with ``Retry-After``).
    no_backend_wait_s: float = attrs.field(default=30.0, validator=between(0.0, 86_400))
    #: How often each backend's health (``/health``, else ``/v1/models``) and its Prometheus
    #: ``/metrics`` are read.
    health_interval_s: float = attrs.field(default=2.0, validator=between(0.01, 3600))
    #: How often each backend's Prometheus ``/metrics`` is read (see ``health_interval_s``).
    metrics_interval_s: float = attrs.field(default=1.0, validator=between(0.01, 3600))
    #: Metrics older than this are not trusted: max_concurrency alone bounds the backend until a fresh reading.
    metrics_max_age_s: float = attrs.field(default=5.0, validator=between(0.01, 86_400))
    #: A backend is saturated (no dispatch to it) with this many requests waiting in its own queue
    #: (vLLM ``vllm:num_requests_waiting``, llama.cpp ``llamacpp:requests_deferred``) ...
    max_waiting: int = attrs.field(default=5, validator=between(1, 10**6))
    #: ... or this share of its KV cache in use (vLLM ``vllm:kv_cache_usage_perc``).
    max_kv_usage: float = attrs.field(default=0.8, validator=between(0.01, 1.0))
    #: Gateway preemption (``[engine] isolation``): a started request is preempted for a tenant below its
    #: share only once it has run this long (model seconds) since it (re)started ...
    preempt_min_run_s: float = attrs.field(default=1.0, validator=between(0.0, 3600))
    #: ... and at most this many times (then it runs to its end).
    max_preemptions: int = attrs.field(default=16, validator=between(0, 1000))


@attrs.frozen
class RoutingConfig:
    """Where a dispatched request runs when there is more than one place: which backend of the
    ``forward`` engine, or which of several ``continuous`` engines (docs/explanation/routing.md).
    Fair share and priority still decide *when*."""

    #: ``prefix`` (to the place that holds the longest part of the conversation in its cache, unless
    #: load is out of balance), ``least-loaded``, ``prefix-hash`` (consistent hashing of the
    #: conversation's start with bounded loads: every replica gives the same answer without sharing
    #: state), or a plugin's routing policy.
    policy: str = attrs.field(default="prefix", validator=non_empty)
    #: ``prefix``: load is out of balance (route to the least loaded) when the fullest place's share of
    #: its slots exceeds the emptiest's by more than this ...
    balance_abs: float = attrs.field(default=0.5, validator=between(0.0, 1.0))
    #: ... and is more than this many times the emptiest's.
    balance_rel: float = attrs.field(default=1.5, validator=between(1.0, 1000.0))
    #: ``prefix``: the share of a request's key the best place must hold for the request to go there;
    #: below it, the request goes to the least loaded place.
    cache_threshold: float = attrs.field(default=0.3, validator=between(0.0, 1.0))
    #: ``prefix``: tokens a backend's prefix cache holds when its ``cache_tokens`` is not set (a
    #: continuous engine's is its KV cache).
    cache_tokens: int = attrs.field(default=262_144, validator=between(1, 10**10))
    #: ``prefix-hash``: blocks of the conversation's start that are hashed (a block is 256 characters).
    hash_blocks: int = attrs.field(default=1, validator=between(1, 1024))
    #: ``prefix-hash``: a place takes a request while its load is at most this times the mean load
    #: (plus one); else the next place on the ring.
    load_factor: float = attrs.field(default=1.25, validator=between(1.0, 100.0))


@attrs.frozen
class PolicyConfig:
    """Which policy of each kind runs, and each policy's own parameters.

    ``preset`` (overridden by ``--policy``) fills in any kind left unset;
    ``params`` holds the ``[policy.<name>]`` tables by policy name, e.g. ``[policy.aps]``.
    """

    #: The preset, which names one policy of each kind (``--policy`` overrides it; ``apsd plugins``
    #: lists the installed presets).
    preset: str = "fair"
    #: An aging policy (the order of the waiting queue), by name, in place of the preset's.
    aging: str | None = None
    #: A governor (the batch window), by name, in place of the preset's.
    governor: str | None = None
    #: A batching policy (when a dispatch is full and what goes in it), by name, in place of the preset's.
    batching: str | None = None
    #: The ``[policy.<name>]`` tables: each policy's own parameters, by policy name.
    params: dict[str, dict[str, Any]] = attrs.field(factory=dict)

    def window_configured(self, governor: str) -> bool:
        """Whether the batch window was asked for: ``[policy] governor`` names one, or the running
        governor's ``[policy.<governor>]`` table is given. An engine that batches by itself
        (``continuous``, ``forward``) runs without a window otherwise: a window there only delays
        every request (the ``batch`` engine, which runs whole batches, always has its governor's)."""
        return self.governor is not None or governor in self.params


@attrs.frozen
class ServiceClassConfig:
    """A service class (``[classes.<name>]``): the latency a request of it is promised, and what
    happens to one that cannot have it (docs/how-to/service-classes.md)."""

    #: Model seconds from admission to the first token a request of this class is promised: its
    #: deadline is its arrival plus this.
    ttft_s: float = attrs.field(validator=between(1e-3, 86_400))
    #: Model seconds per output token after the first (mean) a request must also keep to count as
    #: met; 0: no such target.
    tpot_s: float = attrs.field(default=0.0, validator=off_or_between(1e-6, 3600))
    #: A request that cannot meet its deadline: ``refuse`` (refused 503 ``deadline_unmeetable`` at
    #: admission when the wait ahead of it is estimated past its deadline, or when its deadline
    #: passes while queued) or ``best_effort`` (served anyway, behind requests that can still meet
    #: theirs, and counted as missed if late).
    on_miss: str = attrs.field(default="refuse", validator=either("refuse", "best_effort"))


def optional_price(_inst: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not 0 <= value <= 1e6:
        raise ValueError(f"must be between 0 and 1e+06 (or left out), got {value!r}")


@attrs.frozen
class PriceConfig:
    """What a model's tokens cost the tenants that use it (``[prices.<model>]``), in US dollars per
    million tokens: the spend apsd reports per request, key and tenant, and what dollar budgets
    (``budget_usd``) are held to. Reloadable (SIGHUP); a request is priced at the prices in force when
    it ends. ``[prices."*"]`` prices every model without a table of its own; a request for a model
    without a price (and no ``"*"``) is refused 403 ``model_not_priced`` to a tenant or key with a
    dollar budget, and spends nothing for the others (counted ``unpriced`` in usage)."""

    #: Prompt tokens, but those a backend found in its prefix cache.
    input_per_1m_usd: float = attrs.field(validator=between(0, 1e6))
    #: Output (generated) tokens.
    output_per_1m_usd: float = attrs.field(validator=between(0, 1e6))
    #: Prompt tokens a backend found in its prefix cache (``usage.prompt_tokens_details.cached_tokens``);
    #: unset: at ``input_per_1m_usd``.
    cached_input_per_1m_usd: float | None = attrs.field(default=None, validator=optional_price)

    @property
    def cached_input(self) -> float:
        return self.input_per_1m_usd if self.cached_input_per_1m_usd is None else self.cached_input_per_1m_usd


#: The ``[prices]`` entry that prices every model without one of its own.
ANY_MODEL = "*"


def alert_thresholds(_inst: object, attribute: attrs.Attribute[Any], value: tuple[float, ...]) -> None:
    for i, item in enumerate(value):
        if not 0 < item <= 10:
            raise ValueError(f"entry [{i}]: a share of the budget above 0 and at most 10, got {item!r}")
    if len(set(value)) != len(value):
        raise ValueError("the same threshold is listed twice")


def http_url_or_empty(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value:
        http_url(_inst, attribute, value)


@attrs.frozen
class AlertsConfig:
    """Budget alerts: when what a tenant or a key spent of a budget (tokens or dollars) reaches a
    threshold, apsd says so once per threshold and period, across replicas and restarts: a log line
    (WARNING, ``event=budget_alert``), the gauge ``apsd_budget_alert_threshold``, and, with a
    ``webhook_url``, a signed JSON POST (:mod:`apsd.serve.alerts`; docs/how-to/manage-tenants.md)."""

    #: Shares of a budget at which to alert (1.0: the budget is spent).
    thresholds: tuple[float, ...] = attrs.field(default=(0.8, 1.0), converter=numbers, validator=alert_thresholds)
    #: Where to POST each alert (JSON); empty: log line and gauge only.
    webhook_url: str = attrs.field(default="", validator=http_url_or_empty)
    #: The environment variable holding the shared secret the POST is signed with (HMAC-SHA256 of the
    #: body, in ``X-Apsd-Signature-256: sha256=<hex>``); preferred to ``webhook_secret``.
    webhook_secret_env: str = ""
    #: The shared secret itself (the config file may be world-readable: prefer ``webhook_secret_env``).
    webhook_secret: str = attrs.field(default="", metadata=SECRET_STRING, repr=False)
    #: Wall seconds one POST may take.
    webhook_timeout_s: float = attrs.field(default=5.0, validator=between(0.1, 300))
    #: Attempts per alert: a failed POST (no answer, or 5xx, 408, 429) is retried after 1, 2, 4, ...
    #: seconds (at most 60 between two), then given up with a WARNING.
    webhook_attempts: int = attrs.field(default=6, validator=between(1, 100))


@attrs.frozen
class TracingConfig:
    """OpenTelemetry traces of requests, exported over OTLP/HTTP (the optional extra ``apsd[tracing]``;
    :mod:`apsd.serve.tracing`, docs/how-to/tracing.md): a span per request from its arrival to its
    answer's last byte, with the GenAI conventions' attributes and apsd's own, a child span for its wait
    in the queue and one for each attempt upstream, whose context is sent to the backend as
    ``traceparent``; a client's ``traceparent`` is continued. Off by default, and then free. Read at
    start (a reload does not change it)."""

    #: Trace requests (needs the extra: ``pip install 'apsd[tracing]'``).
    enabled: bool = False
    #: Where spans are sent (OTLP/HTTP, protobuf). Empty: the OpenTelemetry variables
    #: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``, else
    #: ``http://localhost:4318/v1/traces``.
    endpoint: str = attrs.field(default="", validator=http_url_or_empty)
    #: The ``service.name`` of every span's resource.
    service_name: str = attrs.field(default="apsd", validator=non_empty)
    #: The share of requests traced when the client sent no ``traceparent`` (one it sends decides for
    #: its own request: sampled or not).
    sample_ratio: float = attrs.field(default=1.0, validator=between(0.0, 1.0))
    #: Wall seconds finished spans wait to be sent together, at most (and all are sent at shutdown).
    export_interval_s: float = attrs.field(default=5.0, validator=between(0.05, 3600))


def _owner_kind(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in ("", "person", "agent"):
        raise ValueError(f"must be \"person\", \"agent\" or empty, got {value!r}")


@attrs.frozen
class KeyLimits:
    """An issued API key's own limits, each nested under its tenant's: a request with the key is held
    to both, so a key never gets more than its tenant. 0 (or empty) leaves a limit to the tenant."""

    #: Tokens per second of the key's own bucket (0: none; the tenant's bucket applies alone).
    rate: float = attrs.field(default=0.0, validator=between(0, 1e12))
    #: The most its own bucket holds (0: the tenant's ``burst``; never more than it).
    burst: int = attrs.field(default=0, validator=between(0, 10**12))
    #: Tokens it may use per ``budget_period``, across replicas (0: none of its own).
    budget_tokens: int = attrs.field(default=0, validator=between(0, 10**15))
    #: US dollars it may spend per ``budget_period`` (0: none of its own).
    budget_usd: float = attrs.field(default=0.0, validator=between(0, 1e12))
    #: ``day`` or ``month``, in UTC.
    budget_period: str = attrs.field(default="day", validator=either("day", "month"))
    #: Its requests in flight at once (0: only the tenant's limit).
    max_concurrency: int = attrs.field(default=0, validator=between(0, 10**6))
    #: The models it may use, among its tenant's (empty: every model its tenant may use).
    models: tuple[str, ...] = attrs.field(default=(), converter=strings, validator=model_names)


@attrs.frozen
class KeyConfig:
    """An API key issued through ``/admin``, as the running daemon knows it: who it is, and its limits
    (the state keeps the record: :class:`apsd.state.records.KeyRecord`)."""

    key_id: str
    tenant: str
    key_hash: str = attrs.field(repr=False)
    #: A name for people (``ci``, ``alice-laptop``); the key's id when it was issued without one.
    name: str = ""
    #: Who holds it: a person (``alice@example.com``) or an agent (``claude-code/reviewer``).
    owner: str = ""
    #: ``person``, ``agent`` or empty.
    owner_kind: str = ""
    limits: KeyLimits = KeyLimits()

    @property
    def label(self) -> str:
        return self.name or self.key_id


def _default_tenants() -> dict[str, TenantConfig]:
    # Three tenants of different sizes, so the embedded defaults show contention.
    return {
        "tenant_a": TenantConfig(rate=500.0, burst=5000),
        "tenant_b": TenantConfig(rate=300.0, burst=3000),
        "tenant_c": TenantConfig(rate=1000.0, burst=10000),
    }


@attrs.frozen
class Config:
    """The whole configuration; ``Config()`` is the embedded default."""

    server: ServerConfig = ServerConfig()
    auth: AuthConfig = AuthConfig()
    policy: PolicyConfig = PolicyConfig()
    queue: QueueConfig = QueueConfig()
    admission: AdmissionConfig = AdmissionConfig()
    gateway: GatewayConfig = GatewayConfig()
    engine: EngineConfig = EngineConfig()
    gpu: GpuConfig = GpuConfig()
    forward: ForwardConfig = ForwardConfig()
    store: StoreConfig = StoreConfig()
    state: StateConfig = StateConfig()
    routing: RoutingConfig = RoutingConfig()
    backends: tuple[BackendConfig, ...] = ()
    tenants: dict[str, TenantConfig] = attrs.field(factory=_default_tenants)
    #: The service classes, by name (``[classes.<name>]``); tenants name those they may use.
    classes: dict[str, ServiceClassConfig] = attrs.field(factory=dict)
    #: What models' tokens cost tenants, by model name (``[prices.<model>]``; ``"*"``: every other model).
    prices: dict[str, PriceConfig] = attrs.field(factory=dict)
    alerts: AlertsConfig = AlertsConfig()
    tracing: TracingConfig = TracingConfig()
    #: The keys issued through ``/admin`` in force, by id (the state's, never the file's).
    keys: dict[str, KeyConfig] = attrs.field(factory=dict, metadata={"toml": False})
    #: Where this config came from, for error messages ("<defaults>" if embedded).
    source: str = attrs.field(default="<defaults>", metadata={"toml": False})
    #: The file declares ``[tenants]`` (else the embedded default tenants above are in it): a reload
    #: refuses a file that lost them (:meth:`apsd.serve.daemon.Daemon.reload`).
    tenants_declared: bool = attrs.field(default=False, eq=False, metadata={"toml": False})

    def with_overrides(self, **server: Any) -> Config:
        """A copy with ``[server]`` keys replaced (``None`` values are ignored)."""
        changes = {k: v for k, v in server.items() if v is not None}
        return attrs.evolve(self, server=attrs.evolve(self.server, **changes))


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


class ControlCharacterError(ConfigError):
    """A config string or table name with a control character (the message does not show it)."""


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _check_text(text: str, key: str, what: str = "value") -> None:
    """ControlCharacterError naming ``key`` if ``text`` holds a control character: a config string
    ends up in response headers, metrics labels and log lines, where CR, LF and the like either
    break the answer (after the work was done) or forge lines."""
    found = _CONTROL.search(text)
    if found is not None:
        raise ControlCharacterError(f"{key}: the {what} holds a control character (U+{ord(found.group()):04X} at "
                                    f"position {found.start()}): CR, LF, tabs and the like are not allowed in "
                                    "config strings (they end up in headers, labels and logs)")


def _check_value(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp`` strictly; return the converted value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        return _check_value(value, options[0], key)
    if origin is dict:
        _, value_type = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a table, got {type(value).__name__}")
        for name in value:
            _check_text(name, f"{key}.{name!r}", "name")
        return {name: _check_value(v, value_type, f"{key}.{name}") for name, v in value.items()}
    if origin is tuple:  # tuple[X, ...]: a TOML array
        item_type = typing.get_args(tp)[0]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: must be an array, got {value!r}")
        return tuple(_check_value(v, item_type, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is typing.Any:
        return value
    if attrs.has(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a table, got {type(value).__name__}")
        return parse_section(tp, value, key)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{key}: must be {_TYPE_NAMES.get(tp, tp)}, got {value!r}")
    if isinstance(value, str):
        _check_text(value, key)
    return value


#: An attrs class that a TOML table is parsed into (:func:`parse_section`).
Section = TypeVar("Section", bound=attrs.AttrsInstance)


def parse_section(cls: type[Section], table: dict[str, Any], prefix: str = "") -> Section:
    """Build attrs class ``cls`` from a TOML table, naming ``prefix.key`` on error.

    Unknown keys, wrong types (no silent coercion: ``"80"`` is not a port) and
    values its validators refuse are all errors. Policies reuse this for their
    own ``[policy.<name>]`` tables.
    """
    fields = {f.name: f for f in attrs.fields(attrs.resolve_types(cls)) if f.metadata.get("toml", True)}
    dotted = f"{prefix}." if prefix else ""
    unknown = sorted(set(table) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields)) or "none"
        replaced = REPLACED_KEYS.get(f"{dotted}{unknown[0]}")
        if replaced:
            raise ConfigError(f"{dotted}{unknown[0]}: no longer a setting: {replaced}")
        raise ConfigError(f"{dotted}{unknown[0]}: unknown key (known keys: {known})")
    kwargs = {}
    for name, field in fields.items():
        key = f"{dotted}{name}"
        if name not in table:
            if field.default is attrs.NOTHING:
                raise ConfigError(f"{key}: required key is missing")
            continue
        try:
            value = _check_value(table[name], field.type, key)
        except ControlCharacterError:
            raise
        except ConfigError:
            if field.metadata.get("secret"):  # (the usual message shows the value: not for these)
                raise ConfigError(f"{key}: {field.metadata['secret']} (the value given is not shown)") from None
            raise
        if field.validator is not None:
            try:
                field.validator(None, field, value)
            except ValueError as exc:
                raise ConfigError(f"{key}: {exc}") from None
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a rule between keys (the message starts with the key it names)
        raise ConfigError(f"{dotted}{exc}") from None


def _parse_policy(table: dict[str, Any]) -> PolicyConfig:
    """``[policy]``: names are strings; sub-tables are per-policy parameters."""
    names = {k: v for k, v in table.items() if not isinstance(v, dict)}
    params = {k: v for k, v in table.items() if isinstance(v, dict)}
    return attrs.evolve(parse_section(PolicyConfig, names, "policy"), params=params)


def parse_config(data: dict[str, Any], source: str = "<string>") -> Config:
    """Validate a TOML document's data into a :class:`Config`."""
    try:
        data = dict(data)
        policy_table = data.pop("policy", {})
        if not isinstance(policy_table, dict):
            raise ConfigError("policy: must be a table")
        policy = _parse_policy(policy_table)
        if isinstance(data.get("gpu"), dict) and "count" in data["gpu"]:
            raise ConfigError("gpu.count: moved to [engine] count (the number of engines of the configured kind)")
        tenants = data.pop("tenants", None)
        config = parse_section(Config, data)
        if tenants is not None:
            parsed = _check_value(tenants, dict[str, TenantConfig], "tenants")
            if not parsed:
                raise ConfigError("tenants: at least one tenant is required")
            config = attrs.evolve(config, tenants=parsed, tenants_declared=True)
        _check_keys_unique(config)
        check_tenant_classes(config.tenants, config.classes)
        config = _check_backends(config, engine_kind_given="kind" in (data.get("engine") or {}))
        _check_store(config)
        if config.gpu.decode_batch_base + config.gpu.decode_batch_sqrt <= 0:
            raise ConfigError("gpu.decode_batch_sqrt: decode_batch_base + decode_batch_sqrt must be > 0 "
                              "(else nothing ever decodes)")
        return attrs.evolve(config, policy=policy, source=source)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def check_tenant_classes(tenants: Mapping[str, TenantConfig], classes: Mapping[str, Any],
                         prefix: str = "tenants.") -> None:
    """Every class a tenant names is a ``[classes.<name>]`` (ConfigError naming the tenant's key)."""
    for name, tenant in tenants.items():
        for i, wanted in enumerate(tenant.classes):
            if wanted not in classes:
                raise ConfigError(f"{prefix}{name}.classes[{i}]: no class named {wanted!r} "
                                  f"(classes: {', '.join(sorted(classes)) or 'none configured'})")


def _check_backends(config: Config, *, engine_kind_given: bool) -> Config:
    """``[[backends]]`` make the engine ``forward`` (unless ``[engine] kind`` says otherwise, which is
    an error); ``kind = "forward"`` needs at least one backend."""
    if config.backends:
        if engine_kind_given and not config.engine.forwards:
            raise ConfigError(f"engine.kind: [[backends]] are forwarded to by the forward engine; "
                              f"remove kind = {config.engine.kind!r}, or the [[backends]]")
        forwarding = next(name for name, kind in ENGINE_KINDS.items() if kind.forwards)
        config = attrs.evolve(config, engine=attrs.evolve(config.engine, kind=forwarding))
        labels = [b.label for b in config.backends]
        if len(set(labels)) != len(labels):
            raise ConfigError("backends: two backends have the same name (or URL)")
    elif config.engine.forwards:
        raise ConfigError(f"engine.kind: the {config.engine.kind} engine needs at least one [[backends]] entry")
    if not config.engine.simulated and config.gpu.time_scale != 1.0:
        raise ConfigError("gpu.time_scale: real backends run in real time: it must be 1 with [[backends]]")
    return config


def _check_store(config: Config) -> None:
    if config.store.shared:
        if not config.store.url:
            raise ConfigError('store.url: required with kind = "redis" (e.g. "redis://127.0.0.1:6379/0")')
        if config.gpu.time_scale != 1.0:
            raise ConfigError("gpu.time_scale: a shared store times buckets by Redis's clock, in wall seconds: "
                              'it must be 1 with [store] kind = "redis"')
    if config.state.kind == "redis" and not config.store.shared:
        raise ConfigError('state.kind: "redis" keeps the state in [store]\'s Redis: set [store] kind = "redis" '
                          'and its url (or leave state.kind "auto")')


def _check_keys_unique(config: Config) -> None:
    """One key, one identity: a hash may appear once across every tenant, the admin and the scrapers."""
    seen: dict[str, str] = {}
    places = [(f"tenants.{name}.api_key_hashes", h) for name, t in config.tenants.items()
              for h in t.api_key_hashes]
    places += [("auth.admin_key_hashes", h) for h in config.auth.admin_key_hashes]
    places += [(f"auth.admin_keys.{name}", h) for name, h in config.auth.admin_keys.items()]
    places += [("auth.metrics_key_hashes", h) for h in config.auth.metrics_key_hashes]
    for place, value in places:
        if value in seen and seen[value] != place:
            raise ConfigError(f"{place}: the same key hash is also in {seen[value]}; "
                              "each key must identify one tenant, the admin or a metrics scraper")
        seen[value] = place


def read_text(path: Path, what: str, error: type[Exception], encoding: str = "utf-8") -> str:
    """The text of ``path``, or ``error("<path>: no such <what>")`` and the like: one line, no traceback."""
    try:
        return path.read_text(encoding=encoding)
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read {what}: {exc}") from None


def read_toml(path: Path, what: str, error: type[Exception]) -> dict[str, Any]:
    """The TOML document at ``path``, with :func:`read_text`'s errors and a syntax error naming the file."""
    try:
        return tomllib.loads(read_text(path, what, error))
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path}: TOML syntax error: {exc}") from None


def load_config(path: str | Path | None) -> Config:
    """Read and validate ``path``; ``None`` gives the embedded defaults."""
    if path is None:
        return Config()
    path = Path(path)
    data = read_toml(path, "config file", ConfigError)
    if not data:
        raise ConfigError(f"{path}: the file sets nothing (it is empty, or holds only comments: truncated?); "
                          "to run on the embedded defaults, give no config file")
    return parse_config(data, str(path))
