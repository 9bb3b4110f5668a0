"""Usage history: what each tenant used, per hour, model and backend, for chargeback.

:class:`UsageRecorder`, one of the ledger's bookkeepers (:class:`~apsd.core.ledger.Bookkeeper`), is
called as each request ends or is refused, and adds each request to its row (:class:`~apsd.state.records.UsageKey`: the UTC hour it
ended in, its tenant, model, backend and issued key) as counts of named fields; the keeper takes what was
gathered every ``[state] flush_interval_s`` and adds it to the store, where rows of several
flushes and several replicas add up. The fields:

* ``completed``, ``failed``, ``cancelled``: requests by outcome;
* ``refused.<error>``: requests admission refused, by its error code (a fixed set: no client text);
* ``prompt_tokens``, ``output_tokens``: what the tenant was charged (what the backend reported);
* ``cost_usd``: what its requests cost (the engine's or backend's price);
* ``spend_usd``: what its requests cost the tenant at ``[prices]`` (:mod:`apsd.core.prices`), and
  ``unpriced``: requests charged tokens whose model had no price (they spent nothing);
* ``ttft.<i>``, ``latency.<i>``: histograms of time to first token and of latency (completed
  requests, model milliseconds), bucket ``i`` of :data:`~apsd.state.records.LATENCY_BOUNDS_MS`.

:func:`summarize` turns rows into the answer of ``GET /admin/usage``: grouped by hour or day, per
tenant (and per model and backend, and per key, if asked), with percentiles read from the merged
histograms.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from apsd.core.clock import calendar_time
from apsd.core.ledger import Bookkeeper
from apsd.core.models import Completion, InferenceRequest, Outcome, Refusal
from apsd.state.records import UsageKey, histogram_bucket, percentile

__all__ = ["CSV_COLUMNS", "UsageRecorder", "summarize", "to_csv"]

HOUR_S = 3600


class UsageRecorder(Bookkeeper):
    """Gathers usage between two flushes, in memory (bounded by tenants x models x backends x hours); one
    of the ledger's bookkeepers (:meth:`~apsd.core.ledger.Ledger.keep_books_with`): a request's usage is a
    step of its end, not an observation."""

    def __init__(self, tenants: Callable[[], Mapping[str, object]], wall: Callable[[], float] = calendar_time) -> None:
        #: The configured tenants now: a refusal of any other name is not a row (a client cannot grow this).
        self._tenants = tenants
        self._wall = wall
        self._rows: dict[UsageKey, dict[str, float]] = {}

    def _row(self, request: InferenceRequest) -> dict[str, float]:
        hour = int(self._wall()) // HOUR_S * HOUR_S
        key = UsageKey(hour, request.tenant_id, request.model or "", request.backend or "", request.key_id or "")
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = {}
        return row

    @staticmethod
    def _add(row: dict[str, float], field: str, amount: float) -> None:
        row[field] = row.get(field, 0) + amount

    def finished(self, request: InferenceRequest, outcome: Outcome, now: float = 0.0) -> None:
        if request.tenant_id not in self._tenants():
            return
        row = self._row(request)
        add = self._add
        match outcome:
            case Completion():
                add(row, "completed", 1)
                if request.finished_at is not None:
                    add(row, f"latency.{histogram_bucket((request.finished_at - request.arrival) * 1000)}", 1)
                if request.started_at is not None:
                    add(row, f"ttft.{histogram_bucket((request.started_at - request.arrival) * 1000)}", 1)
            case Refusal(kind="failed"):
                add(row, "failed", 1)
            case _:
                add(row, "cancelled", 1)
        if request.prompt_used and request.prompt_tokens:
            add(row, "prompt_tokens", request.prompt_tokens)
        if request.tokens_generated:
            add(row, "output_tokens", request.tokens_generated)
        if request.cost_usd:
            add(row, "cost_usd", request.cost_usd)
        if request.spend_usd:
            add(row, "spend_usd", request.spend_usd)
        if request.unpriced:
            add(row, "unpriced", 1)

    def rejected(self, request: InferenceRequest, refusal: Refusal, now: float = 0.0) -> None:
        if request.tenant_id in self._tenants():
            self._add(self._row(request), f"refused.{refusal.error}", 1)

    def take(self) -> dict[UsageKey, dict[str, float]]:
        """What was gathered since the last call (and forget it)."""
        rows, self._rows = self._rows, {}
        return rows

    def pending(self) -> dict[UsageKey, dict[str, float]]:
        """What was gathered since the last :meth:`take` (a copy; kept)."""
        return {key: dict(fields) for key, fields in self._rows.items()}

    def give_back(self, rows: Mapping[UsageKey, Mapping[str, float]]) -> None:
        """Rows a flush could not write: kept for the next one."""
        for key, fields in rows.items():
            row = self._rows.setdefault(key, {})
            for field, amount in fields.items():
                self._add(row, field, amount)


#: The columns of the CSV answer, in order (those added since the first release at the end).
CSV_COLUMNS = ("period", "tenant", "model", "backend", "requests", "completed", "failed", "cancelled",
               "refused", "prompt_tokens", "output_tokens", "cost_usd", "ttft_p50_ms", "ttft_p99_ms",
               "latency_p50_ms", "latency_p99_ms", "refused_by_error", "key", "key_name", "spend_usd", "unpriced")


def _period(hour: int, group_by: str) -> str:
    moment = time.gmtime(hour)
    return time.strftime("%Y-%m-%dT%H:00:00Z" if group_by == "hour" else "%Y-%m-%d", moment)


def summarize(rows: Mapping[UsageKey, Mapping[str, float]], *, group_by: str, by_model: bool = False,
              by_key: bool = False, key_names: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Rows grouped by period (``hour`` or ``day``, UTC) and tenant (and model and backend if
    ``by_model``, and issued key if ``by_key``: ``""`` for requests with no issued key), oldest first,
    each with its counts and percentiles; ``key_names`` (id -> name) names the keys."""
    groups: dict[tuple[str, str, str, str, str], dict[str, float]] = {}
    for key, fields in sorted(rows.items(), key=lambda item: (item[0].hour, item[0].tenant, item[0].key)):
        group = (_period(key.hour, group_by), key.tenant, key.model if by_model else "*",
                 key.backend if by_model else "*", key.key if by_key else "*")
        merged = groups.setdefault(group, {})
        for field, amount in fields.items():
            merged[field] = merged.get(field, 0) + amount
    names = key_names or {}
    return [_summary(group, fields, names) for group, fields in groups.items()]


def _histogram(fields: Mapping[str, float], name: str) -> dict[int, float]:
    prefix = name + "."
    return {int(field[len(prefix):]): amount for field, amount in fields.items() if field.startswith(prefix)}


def _summary(group: tuple[str, str, str, str, str], fields: Mapping[str, float],
             key_names: Mapping[str, str]) -> dict[str, Any]:
    period, tenant, model, backend, key = group
    refused = {field.removeprefix("refused."): int(amount) for field, amount in sorted(fields.items())
               if field.startswith("refused.")}
    ttft, latency = _histogram(fields, "ttft"), _histogram(fields, "latency")
    outcomes = {name: int(fields.get(name, 0)) for name in ("completed", "failed", "cancelled")}
    return {
        "period": period, "tenant": tenant, "model": model, "backend": backend,
        "requests": sum(outcomes.values()) + sum(refused.values()), **outcomes,
        "refused": sum(refused.values()), "refused_by_error": refused,
        "prompt_tokens": int(fields.get("prompt_tokens", 0)), "output_tokens": int(fields.get("output_tokens", 0)),
        "cost_usd": round(fields.get("cost_usd", 0.0), 6),
        "key": key, "key_name": key_names.get(key, key) if key not in ("", "*") else key,
        "spend_usd": round(fields.get("spend_usd", 0.0), 6), "unpriced": int(fields.get("unpriced", 0)),
        "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
        "latency_p50_ms": percentile(latency, 0.5), "latency_p99_ms": percentile(latency, 0.99),
    }


def to_csv(summaries: Iterable[Mapping[str, Any]]) -> str:
    """:func:`summarize`'s rows as CSV with :data:`CSV_COLUMNS` (``refused_by_error`` as
    ``error=count;...``; an empty percentile as an empty cell)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for row in summaries:
        cells = []
        for column in CSV_COLUMNS:
            value = row[column]
            if column == "refused_by_error":
                value = ";".join(f"{error}={count}" for error, count in value.items())
            cells.append("" if value is None else value)
        writer.writerow(cells)
    return out.getvalue()
