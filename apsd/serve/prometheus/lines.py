"""The per-tenant lines of ``GET /metrics``, rendered by hand, byte for byte as prometheus_client renders
them (its rendering, :meth:`~apsd.serve.prometheus.exporter.PrometheusExporter.collect`, is the reference
that ``tests/daemon/test_prometheus.py`` compares with): a scrape's moment (:class:`Scrape`) is copied
in the trio thread, and :func:`render` turns it into the exposition, reusing the lines of every
tenant whose figures did not move (:class:`Chunks`), in a worker thread that offers the GIL back to
the event loop every few tenants.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.utils import floatToGoString

from apsd.core.service_window import WorkingRow
from apsd.serve.prometheus.families import (
    IN_FLIGHT,
    OUTCOMES,
    REJECTIONS,
    REQUESTS,
    TENANT_COST,
    TENANT_QUEUE,
    TENANT_SPEND,
    TOKENS,
    UNATTRIBUTED,
    WINDOW_FAMILIES,
    WINDOW_FIELDS,
    Families,
)
from apsd.serve.prometheus.histograms import STARTS, TENANT_HISTOGRAMS, HistogramsRow

if TYPE_CHECKING:
    from apsd.core.ledger import TenantStats

#: One tenant's counters as a scrape shows them: admitted, rejected, completed, failed, cancelled
#: (``OUTCOMES``' order), (error, count) pairs sorted, queued, running, prompt and generated tokens, cost,
#: spend.
CounterRow = tuple[int, int, int, int, int, tuple[tuple[str, int], ...], int, int, int, int, float, float]


def counter_row(stats: TenantStats) -> CounterRow:
    return (stats.admitted, stats.rejected, stats.completed, stats.failed, stats.cancelled,
            tuple(sorted(stats.rejected_by_error.items())), stats.queued, stats.running, stats.prompt_tokens,
            stats.generated_tokens, stats.cost_usd, stats.spend_usd)


@attrs.frozen
class Scrape:
    """One scrape's moment, copied in the trio thread: all that rendering it reads."""

    #: Configured tenants, in the ledger's order; the rows of those whose lines must be rendered
    #: (every tenant, or those whose counters moved since the chunks' mark); the ledger's mark.
    tenants: list[str]
    counters: dict[str, CounterRow]
    counters_mark: int
    unattributed: CounterRow
    #: The same for the tenants with histograms, sorted, and the observer's mark.
    histogram_tenants: list[str]
    histograms: dict[str, HistogramsRow]
    histograms_mark: int
    #: The families between the per-tenant counters and the per-tenant histograms, and those after
    #: (a few dozen samples: rendered by prometheus_client itself, in the trio thread).
    middle: bytes
    end: bytes
    #: The tenants with work in the service window (the last families, rendered with the others').
    window: list[WorkingRow]


@attrs.define(eq=False)
class Chunks:
    """Each tenant's rendered lines, one chunk per family, as of the ``ChangeLog`` marks.

    Read and written by one scrape at a time (the exporter's lock). A tenant not logged as
    changed after the mark keeps its chunks; the marks move only once a rendering finished,
    so a rendering that fails half-way is redone from the same marks.
    """

    counters: dict[str, tuple[bytes, ...]] = attrs.field(factory=dict)
    counters_mark: int = 0
    histograms: dict[str, tuple[bytes, ...]] = attrs.field(factory=dict)
    histograms_mark: int = 0


def _escape(value: str) -> str:
    """A label value as prometheus_client's text format escapes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


_SMALL_NUMBERS = tuple(f"{n}.0" for n in range(100_000))


def _number(value: float) -> str:
    """``floatToGoString(value)``; small counts from a table (``repr(float(n))`` is ``"n.0"`` below 10**6)."""
    if type(value) is int and 0 <= value < 100_000:
        return _SMALL_NUMBERS[value]
    text: str = floatToGoString(value)   # (prometheus_client leaves it unannotated)
    return text


def _header(kind: type[CounterMetricFamily] | type[GaugeMetricFamily] | type[HistogramMetricFamily], name: str,
            documentation: str) -> bytes:
    """A family's ``# HELP`` and ``# TYPE`` lines, as prometheus_client renders them."""
    return generate_latest(Families([kind(name, documentation, labels=["tenant"])]))


_COUNTER_HEADERS = (_header(CounterMetricFamily, *REQUESTS), _header(CounterMetricFamily, *REJECTIONS),
                    _header(GaugeMetricFamily, *IN_FLIGHT), _header(CounterMetricFamily, *TOKENS),
                    _header(CounterMetricFamily, *TENANT_COST), _header(GaugeMetricFamily, *TENANT_QUEUE),
                    _header(CounterMetricFamily, *TENANT_SPEND))
_WINDOW_HEADERS = tuple(_header(GaugeMetricFamily, name, documentation) for name, documentation in WINDOW_FAMILIES)
_HISTOGRAM_HEADERS = tuple(_header(HistogramMetricFamily, name, documentation)
                           for name, documentation, _ in TENANT_HISTOGRAMS)
#: Per histogram family: each ``_bucket`` line's start, up to the tenant label.
_BUCKET_PREFIXES = tuple(tuple(f'{name}_bucket{{le="{floatToGoString(bound)}",' for bound in (*bounds, math.inf))
                         for name, _, bounds in TENANT_HISTOGRAMS)


def _counter_chunks(tenant: str, row: CounterRow, attributed: bool = True) -> tuple[bytes, ...]:
    """One tenant's lines of each per-tenant counter family (``_COUNTER_HEADERS``' order); the
    unattributed row has only its non-zero outcomes (and ``rejected``) and its rejections."""
    label = f'tenant="{_escape(tenant)}"'
    requests = "".join([f'apsd_requests_total{{outcome="{outcome}",{label}}} {_number(value)}\n'
                        for outcome, value in zip(OUTCOMES, row[:5]) if attributed or value or outcome == "rejected"])
    rejections = "".join([f'apsd_rejections_total{{error="{_escape(error)}",{label}}} {_number(count)}\n'
                          for error, count in row[5]])
    if not attributed:
        return requests.encode(), rejections.encode(), b"", b"", b"", b"", b""
    _, _, _, _, _, _, queued, running, prompt, generated, cost, spend = row
    return (requests.encode(), rejections.encode(),
            (f'apsd_requests_in_flight{{state="queued",{label}}} {_number(queued)}\n'
             f'apsd_requests_in_flight{{state="running",{label}}} {_number(running)}\n').encode(),
            (f'apsd_tokens_total{{phase="prompt",{label}}} {_number(prompt)}\n'
             f'apsd_tokens_total{{phase="generated",{label}}} {_number(generated)}\n').encode(),
            f'apsd_tenant_cost_usd_total{{{label}}} {_number(cost)}\n'.encode(),
            f'apsd_tenant_queue_depth{{{label}}} {_number(queued)}\n'.encode(),
            f'apsd_tenant_spend_usd_total{{{label}}} {_number(spend)}\n'.encode())


def _window_chunks(rows: Sequence[WorkingRow]) -> list[bytes]:
    """The lines of each ``WINDOW_FAMILIES`` family, headers included."""
    chunks = []
    for (name, _), header, field in zip(WINDOW_FAMILIES, _WINDOW_HEADERS, WINDOW_FIELDS):
        lines = [f'{name}{{tenant="{_escape(row[0])}"}} {_number(row[field])}\n' for row in rows]
        chunks += [header, "".join(lines).encode()]
    return chunks


def _histogram_chunks(tenant: str, row: HistogramsRow) -> tuple[bytes, ...]:
    """One tenant's lines of each per-tenant histogram family (``_HISTOGRAM_HEADERS``' order)."""
    label = f'tenant="{_escape(tenant)}"'
    counts, sums = row
    chunks = []
    for which, ((name, _, _), prefixes) in enumerate(zip(TENANT_HISTOGRAMS, _BUCKET_PREFIXES)):
        cumulative = list(itertools.accumulate(counts[STARTS[which]:STARTS[which + 1]]))
        lines = [f"{prefix}{label}}} {_number(count)}\n" for prefix, count in zip(prefixes, cumulative)]
        lines.append(f"{name}_count{{{label}}} {_number(cumulative[-1])}\n"
                     f"{name}_sum{{{label}}} {_number(sums[which])}\n")
        chunks.append("".join(lines).encode())
    return tuple(chunks)


#: Tenants a worker thread renders between two offers of the GIL (about 0.5 ms of work).
_TENANTS_PER_GIL_RELEASE = 16
#: Held for ever: a worker thread waits a microsecond on it to hand the GIL to the event loop.
_NEVER_RELEASED = threading.Lock()
_NEVER_RELEASED.acquire()


def _offer_gil() -> None:
    """Let the event loop's thread take the GIL if it wants it, in a worker thread.

    A call that merely drops the GIL for an instant (``select`` with no timeout, ``os.sched_yield``)
    takes it back before the waiting thread wakes; blocking for a moment on a lock hands it over,
    as ``time.sleep(0)`` would (apsd keeps ``time`` for trio's clock: tests/unit/test_codebase.py). It
    reads no clock and waits for nothing but the handover.
    """
    _NEVER_RELEASED.acquire(timeout=1e-6)


def render(scrape: Scrape, chunks: Chunks, *, in_worker: bool = False) -> bytes:
    """The exposition of ``scrape``: the tenants it carries rendered into ``chunks``, the others'
    lines taken from there. Reads nothing but its arguments (it may run in a worker thread).

    ``in_worker``: offer the GIL to the event loop every few tenants (:func:`_offer_gil`). Left to
    itself a busy thread keeps the GIL for the 5 ms switch interval, and the event loop, which
    gives it up at every socket call, would wait that long after each one (the convoy effect).
    The final join of the chunks holds no GIL at all (``bytes.join`` lets go above 1 MB).
    """
    rendered_since_pause = 0

    def pause() -> None:
        nonlocal rendered_since_pause
        rendered_since_pause += 1
        if in_worker and rendered_since_pause >= _TENANTS_PER_GIL_RELEASE:
            rendered_since_pause = 0
            _offer_gil()

    for tenant, row in scrape.counters.items():
        chunks.counters[tenant] = _counter_chunks(tenant, row)
        pause()
    for tenant, histograms in scrape.histograms.items():
        chunks.histograms[tenant] = _histogram_chunks(tenant, histograms)
        pause()
    chunks.counters_mark, chunks.histograms_mark = scrape.counters_mark, scrape.histograms_mark
    unattributed = _counter_chunks(UNATTRIBUTED, scrape.unattributed, attributed=False)
    rendered = [chunks.counters[tenant] for tenant in scrape.tenants]
    parts: list[bytes] = []
    for index, header in enumerate(_COUNTER_HEADERS):
        parts.append(header)
        parts.extend([tenant_chunks[index] for tenant_chunks in rendered])
        parts.append(unattributed[index])
    parts.append(scrape.middle)
    rendered = [chunks.histograms[tenant] for tenant in scrape.histogram_tenants]
    for index, header in enumerate(_HISTOGRAM_HEADERS):
        parts.append(header)
        parts.extend([tenant_chunks[index] for tenant_chunks in rendered])
    parts.append(scrape.end)
    parts += _window_chunks(scrape.window)
    return b"".join(parts)
