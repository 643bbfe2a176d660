"""pdserve.planner: how many prefill and decode replicas to run (pure decisions, no I/O).

The control loop, as the operator and ``pdserve up --autoscale`` run it:

1. **observe a window** - scrapes of every ready replica's /metrics (``observe.py``), or
   PromQL over a Prometheus (``promql.py``), become one ``Window``: TTFT and TBT
   percentiles against the SLO, the queue at prefill and its growth, decode KV utilisation,
   prefill busy time, token rates, requests in flight.
2. **decide** - ``Planner.decide(window, replicas)`` gives each pool a ``Decision``: the
   desired replicas within [min, max] and a reason a person can read. Up fast (bursts are
   sized by where the queue is going), down slowly (the highest recommendation of a
   stabilisation window, one replica at a time, a cooldown after every change, and only to a
   count whose survivors stay below target).
3. **apply** - the caller's job: the operator writes the pools' scale subresource (and the
   pod-deletion cost of the least loaded pod first); ``pdserve up`` starts processes, or
   drains the least loaded one and stops it only when its requests are done.
4. **record** - the caller again: status and Kubernetes Events, or a line and
   ``servers.json`` locally; the reason travels with every change.

Reading path: ``window.py`` (the input), ``config.py`` (targets, bounds, tuning),
``recommend.py`` (what one window calls for, and why), ``planner.py`` (memory:
stabilisation, cooldown, confirmation, bounds), then ``observe.py`` + ``exposition.py``
(/metrics text -> Window) and ``promql.py`` (Prometheus queries and answers -> Window).

This package imports no other part of pdserve (the design allows ``pdserve.defaults``); the operator and
``localcluster`` import it.
"""

from .config import POOLS, PlannerConfig, PoolLimits
from .planner import Decision, Plan, Planner
from .recommend import Recommendation, recommend
from .window import PoolLoad, Window

__all__ = ["POOLS", "PlannerConfig", "PoolLimits", "Planner", "Plan", "Decision", "Recommendation", "recommend",
           "PoolLoad", "Window"]
