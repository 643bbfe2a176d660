"""pdserve.slo: SLO-aware queueing after QLM (SoCC '24), as pure logic both front doors use.

Part of the shared runtime (no I/O, no asyncio, no server imports), so the prefill and the
router can hold the same queue. An InferenceService's ``spec.slo`` declares named classes;
each request picks one; waiting requests form request groups; an estimator learned online
says how long each will wait, prefill and decode; a policy orders the queue; a request that
cannot meet its SLO even if served next can be refused at once.

Reading path (in this order):
  ``classes.py``       SloClass / SloClasses: parsing ``spec.slo`` (flag, env), selection by header or priority
  ``estimator.py``     QLM eq. 1-4: prefill fit, per-token decode time, output lengths, K-slot plan
  ``groups.py``        QLM Algorithm 1: groups by (class, length bucket), split when too large
  ``policies.py``      fifo | edf | qlm (the global scheduler: greedy reordering of groups)
  ``global_queue.py``  GlobalQueue: a front door's requests, estimates, early rejection, metrics
"""

from .classes import DEFAULT_CLASS, HEADER, SloClass, SloClasses, load, parse
from .estimator import Estimate, Estimator, Job
from .global_queue import GlobalQueue, Rejected, SloRequest
from .policies import POLICIES

__all__ = ["DEFAULT_CLASS", "HEADER", "POLICIES", "Estimate", "Estimator", "GlobalQueue", "Job", "Rejected",
           "SloClass", "SloClasses", "SloRequest", "load", "parse"]
