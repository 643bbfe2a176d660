"""pdserve.slo: SLO-aware queueing after QLM (SoCC '24), as pure logic both front doors use.

Part of the shared runtime (no I/O, no asyncio, no server imports), so the prefill and the
router can hold the same queue. An InferenceService's ``spec.slo`` declares named classes;
each request picks one; waiting requests form request groups; an estimator learned online
says how long each will wait, prefill and decode; a policy orders the queue; a request that
cannot meet its SLO even if served next can be refused at once.

Reading path (in this order):
  ``classes.py``       SloClass / SloClasses: parsing ``spec.slo`` (flag, env), selection by header or priority
  ``measures.py``      what is learned online: per-token time, prefill line, output lengths per class
  ``estimator.py``     QLM eq. 1-4: estimates from those, the plan of a queue (KV blocks or K slots)
  ``groups.py``        QLM Algorithm 1: groups by (class, length bucket), split when too large
  ``policies.py``      fifo | edf | qlm (the global scheduler: greedy reordering of groups)
  ``global_queue.py``  GlobalQueue: a front door's requests, estimates, early rejection, order
  ``accounting.py``    SloAccounting: per-class metrics and the records of finished requests
"""

from .classes import DEFAULT_CLASS, HEADER, SloClass, SloClasses, load, parse
from .estimator import Estimate, Estimator, Job
from .global_queue import GlobalQueue, Rejected, SloRequest
from .policies import POLICIES

__all__ = ["DEFAULT_CLASS", "HEADER", "POLICIES", "Estimate", "Estimator", "GlobalQueue", "Job", "Rejected",
           "SloClass", "SloClasses", "SloRequest", "load", "parse"]
