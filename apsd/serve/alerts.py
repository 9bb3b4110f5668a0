"""Budget alerts: a tenant or a key reached a share of a budget; said once per threshold and period.

What is watched: every budget in force (``budgets.limits()``: tenants' and keys', tokens and dollars,
:mod:`apsd.core.budget`), every :data:`CHECK_INTERVAL_S` wall seconds, against ``[alerts] thresholds``
(default 80% and 100%). A budget whose period's spend (every replica's, as this replica last heard
it) reached a threshold gets, once per threshold and period:

* a log line (WARNING, ``event=budget_alert``) naming the tenant (and key), the unit, the spend and the
  limit;
* a POST to ``[alerts] webhook_url``, when one is set: the JSON body :func:`alert_body` builds, with
  ``X-Apsd-Event: budget_alert``, ``X-Apsd-Delivery`` (the alert's id, the same on every attempt)
  and, with a shared secret (``webhook_secret_env``, else ``webhook_secret``), ``X-Apsd-Signature-256:
  sha256=<hex>``: HMAC-SHA256 of the body's exact bytes with the secret (GitHub's scheme: a receiver
  computes the same and compares in constant time). A POST that gets no answer within
  ``webhook_timeout_s``, or a 5xx, 408 or 429, is tried again after 1, 2, 4, ... seconds (at most 60),
  up to ``webhook_attempts`` times in all, then given up with a WARNING; another 4xx is given up at
  once (the receiver refuses it).

The gauges ``apsd_budget_used_ratio`` and ``apsd_budget_alert_threshold`` (the highest threshold the
spend reached) are computed at each scrape from the same budgets (:mod:`apsd.serve.prometheus`), so
they need nothing from here.

**Once**, across replicas and restarts: before alerting, a replica claims the alert in the state
(:meth:`apsd.state.keeper.StateKeeper.claim_alert`: an ``INSERT OR IGNORE`` in SQLite, a ``SET NX`` in
Redis); only the replica whose claim succeeds logs and posts. A state that cannot be reached now
leaves the alert unclaimed, and it is tried again at the next check. With ``[state] kind = "off"``
the claim is this process's own (a restart may alert again). A delivery that fails for good is not
tried again in the period: the claim stands, the log says so.

Ownership: the daemon runs :meth:`BudgetAlerts.run` in its nursery; deliveries run in a nursery of
its own, each bounded by its attempts and timeouts. Wall time: the periods and ``at`` are calendar
time (the keeper's clock); the waits are trio's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import trio

from apsd.core.budget import MICRO, TOKENS, BudgetLimit, BudgetView, period_key
from apsd.core.config import AlertsConfig

if TYPE_CHECKING:
    from apsd.pipeline import Pipeline
    from apsd.state.keeper import StateKeeper

__all__ = ["CHECK_INTERVAL_S", "SIGNATURE_HEADER", "Alert", "BudgetAlerts", "alert_body", "reached", "sign"]

log = logging.getLogger("apsd.alerts")

#: Wall seconds between two looks at the budgets.
CHECK_INTERVAL_S = 1.0
#: The longest wait between two attempts of a delivery, wall seconds.
MAX_BACKOFF_S = 60.0
SIGNATURE_HEADER = "X-Apsd-Signature-256"


def sign(secret: str, body: bytes) -> str:
    """The signature header's value for ``body``: ``sha256=`` and the HMAC-SHA256 of it, hex."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


@attrs.frozen
class Alert:
    """A budget that reached a threshold in a period."""

    limit: BudgetLimit
    view: BudgetView
    threshold: float
    #: The period's key (``2026-11-26``, ``2026-11``).
    period: str
    #: Unix seconds when it was found.
    at: float
    #: The key's name (None: the tenant's own budget).
    key_name: str | None = None

    @property
    def alert_id(self) -> str:
        return f"{self.limit.account}:{self.period}:{self.threshold:g}"

    def amount(self, value: int) -> float | int:
        return value if self.limit.unit == TOKENS else round(value / MICRO, 6)


def alert_body(alert: Alert) -> dict[str, Any]:
    """The webhook's JSON body: what was reached, by whom, in which unit (tokens, or US dollars)."""
    limit, view = alert.limit, alert.view
    return {"type": "budget_alert", "id": alert.alert_id, "at": alert.at, "tenant": limit.tenant,
            "key": None if limit.key_id is None else {"id": limit.key_id, "name": alert.key_name},
            "unit": limit.unit, "threshold": alert.threshold, "limit": alert.amount(limit.limit),
            "spent": alert.amount(view.spent), "used_ratio": round(view.used_ratio, 6),
            "period": limit.period, "period_key": alert.period, "resets_at": view.resets_at}


def reached(spent: int, limit: int, threshold: float) -> bool:
    """Whether ``spent`` of ``limit`` reached ``threshold`` (a share), in integers: 83,200 of 104,000 is
    80%, whatever ``0.8 * 104000`` rounds to in binary."""
    return spent * 1_000_000 >= round(threshold * 1_000_000) * limit


def _retryable(status: int) -> bool:
    return status >= 500 or status in (408, 429)


@attrs.define(eq=False)
class BudgetAlerts:
    """Watches the budgets of ``pipeline`` and says when one reaches a threshold (see the module)."""

    pipeline: Pipeline
    keeper: StateKeeper | None
    environ: Mapping[str, str] = attrs.field(factory=lambda: os.environ)
    #: Unix seconds now (the keeper's clock; a test passes its own).
    wall: Callable[[], float] | None = None
    #: Alerts this process claimed or saw claimed (account, period, threshold): never asked again.
    _done: set[tuple[str, str, float]] = attrs.field(factory=set)
    #: Deliveries sent and failed for good (the figures a test or the log reads).
    delivered: int = 0
    failed: int = 0

    def _now(self) -> float:
        if self.wall is not None:
            return self.wall()
        if self.keeper is not None:
            return self.keeper.wall()
        from apsd.core.clock import calendar_time

        return calendar_time()

    @property
    def settings(self) -> AlertsConfig:
        return self.pipeline.config.alerts

    def due(self) -> list[Alert]:
        """The thresholds reached that this process has not alerted (nor seen claimed) yet."""
        budgets = self.pipeline.admission.budgets
        now = self._now()
        found = []
        for account, limit in budgets.limits().items():
            view = budgets.view(limit)
            period = period_key(limit.period, now)
            for threshold in sorted(self.settings.thresholds):
                if not reached(view.spent, limit.limit, threshold) or (account, period, threshold) in self._done:
                    continue
                key = self.pipeline.config.keys.get(limit.key_id) if limit.key_id is not None else None
                found.append(Alert(limit, view, threshold, period, now, key.label if key is not None else None))
        return found

    async def _claim(self, alert: Alert) -> bool:
        if self.keeper is None or self.keeper.store is None:
            return True
        return await self.keeper.claim_alert(alert.limit.account, alert.period, alert.threshold, alert.at)

    async def check(self, nursery: trio.Nursery) -> None:
        """Claim and send what is due (deliveries start in ``nursery``)."""
        for alert in self.due():
            try:
                claimed = await self._claim(alert)
            except Exception as exc:  # (the state cannot be reached now: the next check tries again)
                log.debug("budget alert %s not claimed yet: %s: %s", alert.alert_id, type(exc).__name__, exc)
                continue
            self._done.add((alert.limit.account, alert.period, alert.threshold))
            if not claimed:
                continue
            limit, view = alert.limit, alert.view
            log.warning("budget alert: %s has spent %s of its %s %s budget (%.1f%%: threshold %g%%)",
                        limit.who, limit.amount(view.spent), limit.amount(limit.limit), limit.period,
                        100 * view.used_ratio, 100 * alert.threshold,
                        extra={"event": "budget_alert", "tenant": limit.tenant})
            if self.settings.webhook_url:
                nursery.start_soon(self.deliver, alert)

    def secret(self) -> str:
        settings = self.settings
        if settings.webhook_secret_env:
            return self.environ.get(settings.webhook_secret_env, "")
        return settings.webhook_secret

    async def deliver(self, alert: Alert) -> bool:
        """POST the alert to the webhook, retried with backoff (see the module); whether it was taken."""
        import httpx

        settings = self.settings
        body = json.dumps(alert_body(alert), separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "apsd", "X-Apsd-Event": "budget_alert",
                   "X-Apsd-Delivery": alert.alert_id}
        secret = self.secret()
        if secret:
            headers[SIGNATURE_HEADER] = sign(secret, body)
        wait, why = 1.0, ""
        async with httpx.AsyncClient(timeout=settings.webhook_timeout_s, follow_redirects=False) as client:
            for attempt in range(1, settings.webhook_attempts + 1):
                try:
                    with trio.fail_after(settings.webhook_timeout_s):
                        answer = await client.post(settings.webhook_url, content=body, headers=headers)
                except (httpx.HTTPError, trio.TooSlowError, OSError) as exc:
                    why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                else:
                    if answer.status_code < 300:
                        self.delivered += 1
                        log.info("budget alert %s delivered to the webhook (attempt %d)", alert.alert_id, attempt,
                                 extra={"event": "budget_alert"})
                        return True
                    why = f"answered {answer.status_code}"
                    if not _retryable(answer.status_code):
                        break
                if attempt < settings.webhook_attempts:
                    await trio.sleep(wait)
                    wait = min(MAX_BACKOFF_S, wait * 2)
        self.failed += 1
        log.warning("budget alert %s not delivered to the webhook (%s); given up", alert.alert_id, why,
                    extra={"event": "budget_alert"})
        return False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check every :data:`CHECK_INTERVAL_S` until cancelled (a failed check is logged, not fatal)."""
        async with trio.open_nursery() as deliveries:
            task_status.started()
            while True:
                try:
                    await self.check(deliveries)
                except Exception:
                    log.exception("the budget alerts' check failed; the next one is in %g s", CHECK_INTERVAL_S)
                await trio.sleep(CHECK_INTERVAL_S)
