"""Warning Events for degraded pools: once per distinct problem, not on every status refresh.

Statuses are recomputed on every Deployment and pod event, and a problem's words change while
it lasts (the kubelet alternates ErrImagePull and ImagePullBackOff, a back-off grows, a
crashing pod is replaced). So a pool's problem is announced (a Warning Event on the pool and on
its InferenceService; the router's on the InferenceService only) when its Degraded condition
is True with a *subject* not announced for that pool since it was last healthy: the
``PodProblem.subject``, or the reason and message of a Deployment condition. A pool that is
no longer Degraded is forgotten, so a problem that comes back is announced again.

The memory is this operator process's, keyed by the pool's uid (a pool made again under the
same name starts afresh). After a restart, a pool whose stored Degraded condition carried the
same reason since before this process started counts as announced, so a restart does not
repeat Events (one that turned Degraded while this process ran, and whose Events a failed
refresh did not post, is announced).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import kopf


@dataclass(frozen=True, slots=True)
class PoolHealth:
    """A pool's freshly computed Degraded condition, with what the ledger and the Events need."""
    key: str              # the ledger's key: the pool's uid ("<isvc uid>/router" for the router)
    pool_name: str        # "prefill", a decode pool's name, "router"
    pool: dict | None     # the PrefillPool / DecodePool object (None for the router)
    isvc: dict
    degraded: dict        # the new Degraded condition
    subject: tuple        # what identifies the problem while it lasts
    stored: dict | None   # the Degraded condition the status held before this refresh


class ProblemLedger:
    """Which problems were announced, per pool; safe to share between handler threads."""

    def __init__(self, started: str) -> None:
        """started: when this process started, as status.now() writes lastTransitionTime."""
        self._started = started
        self._announced: dict[str, set[tuple]] = {}
        self._lock = threading.Lock()

    def is_new(self, health: PoolHealth) -> bool:
        """Whether to announce this pool's problem now (and remember it if so); a healthy pool is forgotten."""
        degraded, stored = health.degraded, health.stored or {}
        with self._lock:
            if degraded.get("status") != "True":
                self._announced.pop(health.key, None)
                return False
            seen = self._announced.get(health.key)
            if seen is None:
                seen = self._announced[health.key] = set()
                if (stored.get("status") == "True" and stored.get("reason") == degraded.get("reason")
                        and stored.get("lastTransitionTime", self._started) < self._started):
                    seen.add(health.subject)  # announced by the operator that ran before
            if health.subject in seen:
                return False
            seen.add(health.subject)
            return True


def post(health: PoolHealth) -> None:
    """Queue its Warning Events through kopf's poster (call from a kopf handler's thread)."""
    reason, message = health.degraded["reason"], health.degraded.get("message", "")
    if health.pool is not None:
        kopf.warn(health.pool, reason=reason, message=message)
    kopf.warn(health.isvc, reason=reason, message=f"{health.pool_name}: {message}")
