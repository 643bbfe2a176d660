"""SloAccounting: what the global queue reports about its requests, by SLO class.

Metrics (when given a ServerMetrics; names in ``pdserve.metrics``): requests by class and
outcome (ok | error | cancelled | rejected), SLO met/missed per class and target (ttft, tbt,
e2e and all; a rejected or failed request misses every target of its class, a cancelled one
is not judged), queue time by class, requests waiting by class, the estimate's error (part
queue: the wait, part e2e: the completion time) and the policy's cost per decision. Every
series of a class exists from the start (at 0), so that rates and ratios have data.

Records: the last ``KEEP_RECORDS`` finished requests, each with its estimate at arrival,
what happened and what the estimate was made from (``/debug/slo``; the experiments read
them to measure the estimator).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .classes import SloClass, SloClasses

if TYPE_CHECKING:
    from pdserve.metrics import ServerMetrics

KEEP_RECORDS = 1024
OUTCOMES = ("ok", "error", "cancelled", "rejected")


class SloAccounting:
    def __init__(self, classes: SloClasses, metrics: ServerMetrics | None = None, keep: int = KEEP_RECORDS):
        self.metrics = metrics
        self.records: deque[dict] = deque(maxlen=keep)
        if metrics is None:
            return
        for c in classes:
            metrics.slo_queued.labels(slo_class=c.name).set(0)
            metrics.slo_queue_time.labels(slo_class=c.name)
            for part in ("queue", "e2e"):
                metrics.slo_estimate_error.labels(slo_class=c.name, part=part)
            for outcome in OUTCOMES:
                metrics.slo_requests.labels(slo_class=c.name, outcome=outcome)
            for target in (*c.targets, "all") if c.targets else ():
                for result in ("met", "missed"):
                    metrics.slo_attainment.labels(slo_class=c.name, target=target, result=result)

    def queued(self, cls: SloClass, n: int) -> None:
        if self.metrics is not None:
            self.metrics.slo_queued.labels(slo_class=cls.name).set(n)

    def decision(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.slo_policy.observe(seconds)

    def admitted(self, req, waited: float) -> None:  # req: a global_queue.SloRequest (it imports this module)
        m = self.metrics
        if m is None:
            return
        m.slo_queue_time.labels(slo_class=req.cls.name).observe(waited)
        if req.estimate is not None:
            m.slo_estimate_error.labels(slo_class=req.cls.name, part="queue").observe(abs(req.estimate.wait - waited))

    def finished(self, req, outcome: str, ttft: float | None, e2e: float) -> None:
        est = req.estimate
        waited = None if req.admitted_at is None else req.admitted_at - req.arrival
        self.records.append({
            "request_id": req.request_id, "slo_class": req.cls.name, "outcome": outcome, "tokens": req.tokens,
            "arrival": req.arrival, "admitted": req.admitted_at,
            "estimate": None if est is None else {"wait": est.wait, "first_token": est.first_token, "e2e": est.total,
                                                  "output_tokens": est.output_tokens},
            "actual": {"wait": waited, "first_token": ttft, "e2e": e2e}, "met": req.verdict, "inputs": req.inputs,
        })
        m = self.metrics
        if m is None:
            return
        m.slo_requests.labels(slo_class=req.cls.name, outcome=outcome).inc()
        for target, met in req.verdict.items():
            m.slo_attainment.labels(slo_class=req.cls.name, target=target, result="met" if met else "missed").inc()
        if req.verdict:
            m.slo_attainment.labels(slo_class=req.cls.name, target="all",
                                    result="met" if all(req.verdict.values()) else "missed").inc()
        if outcome == "ok" and est is not None:
            m.slo_estimate_error.labels(slo_class=req.cls.name, part="e2e").observe(abs(est.total - e2e))

    def recent(self, n: int) -> list[dict]:
        return list(self.records)[-n:] if n > 0 else []
