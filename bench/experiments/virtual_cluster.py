"""The scale experiment's cluster on a virtual clock (``pdserve bench experiment scale --clock virtual``).

One process, no servers, no sleeps: ``--prefills`` ``VirtualPrefill`` (the real sim engine each, stepped by
events) and ``--decodes`` ``VirtualDecode`` (the real BlockManager each, the profile's step time) behind the real
``Router`` (``router/router.py``: its ``decide``, ``choice.choose`` / ``round_robin`` and the ``PrefixIndex``
fed by the prefills' own KV events). The router's ``PrefillSet`` is ``StandInPrefills``: the prefills as the
router's watches see them, each load report (``in_flight``, free blocks) polled every ``load_interval_s`` of
simulated time, and the router's own count of the requests it relays to each (``PrefillWatch.in_flight``).

A request's way (times simulated): it arrives at its trace time, the router decides at once (its hashing and
decision cost no simulated time: the router is not modelled as a server with a core), the prefill serves it
(``virtual_prefill.py``), its first token reaches the client when its KV is on the decode, the decode streams the
rest (``virtual_decode.py``), and its last token ends it on the router and the prefill. Figures
(``VirtualCluster.results``) are the client's view (``loadgen_report.RequestResult``) and each server's modelled
busy seconds, prefix hits and events.

Fidelity: the decisions and the cache contents are the product's own code on the same inputs; what differs from
the process cluster (``--clock wall``) is the time its Python, gRPC, HTTP and sockets take, which is zero here;
``scale.py --clock both`` measures the difference on the same requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

from pdserve.cachestore.link_model import LinkModel
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.sim.profile import SimProfile
from pdserve.kv_index import PrefixIndex
from pdserve.prefill_server.picker import DecodePicker
from pdserve.router.router import Router

from .scale_workload import BlockPrompt
from .virtual_clock import Clock, VRequest
from .virtual_decode import VirtualDecode
from .virtual_prefill import VirtualPrefill

ROUTER_LOAD_INTERVAL_S = 0.2  # PrefillSet's load_interval_s default
DECODE_LOAD_INTERVAL_S = 0.3  # LoadReportPoller's interval_s default
LOAD_WEIGHT = 64.0  # the router's --load-weight default


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    prefills: int
    decodes: int
    num_blocks: int  # per server
    block_size: int = 64
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 32  # the servers' --max-num-seqs default
    max_model_len: int = 131072
    link_gbps: float = 400.0
    link_latency_us: float = 5.0
    policy: str = "prefix"  # the router's
    load_weight: float = LOAD_WEIGHT
    picker: str = "wrr"
    decode_reuse: bool = True


class StandInWatch:
    """What ``Router.decide`` reads of one prefill: its last load report and the router's own in-flight count."""

    def __init__(self, prefill: VirtualPrefill):
        self.prefill, self.address = prefill, prefill.address
        self.in_flight = 0
        self.report()

    def report(self) -> None:
        p = self.prefill
        self.load = SimpleNamespace(in_flight=p.in_flight, kv_blocks_free=p.engine.num_free_blocks(),
                                    block_size=p.block_size)


class StandInPrefills:
    """The router's ``PrefillSet`` over the virtual prefills: every one routable, loads polled on the clock."""

    def __init__(self, clock: Clock, prefills: list[VirtualPrefill], interval_s: float = ROUTER_LOAD_INTERVAL_S):
        self.clock, self.interval_s = clock, interval_s
        self.watches = {p.address: StandInWatch(p) for p in prefills}
        self._polled = -1.0

    def routable(self) -> list[StandInWatch]:
        if self.clock.now - self._polled >= self.interval_s:
            self._polled = self.clock.now
            for w in self.watches.values():
                w.report()
        return [w for _, w in sorted(self.watches.items())]


class VirtualCluster:
    def __init__(self, spec: ClusterSpec, profile: SimProfile):
        self.spec, self.profile, self.clock = spec, profile, Clock()
        self.router_index, self.decode_index = PrefixIndex(), (PrefixIndex() if spec.decode_reuse else None)
        model = profile.model
        block_bytes = model.kv_bytes_per_token * spec.block_size
        self.decodes = {f"d{i:03d}": VirtualDecode(f"d{i:03d}", self.clock, profile.step, spec.num_blocks,
                                                   spec.block_size, block_bytes, spec.max_num_seqs, self.decode_index)
                        for i in range(spec.decodes)}
        config = EngineConfig(num_blocks=spec.num_blocks, block_size=spec.block_size, max_num_seqs=spec.max_num_seqs,
                              max_model_len=spec.max_model_len, max_num_batched_tokens=spec.max_num_batched_tokens,
                              detokenize=False)
        self.prefills: dict[str, VirtualPrefill] = {}
        for i in range(spec.prefills):
            address = f"p{i:03d}"
            link = LinkModel(spec.link_gbps * 1e9 / 8, spec.link_latency_us / 1e6)
            picker = DecodePicker(policy=spec.picker, clock=lambda: self.clock.now)
            p = VirtualPrefill(address, self.clock, profile, config, link, picker, self.decodes, self.decode_index,
                               self.router_index, DECODE_LOAD_INTERVAL_S)
            p.on_first_token, p.failed = self._first_token, self._failed
            self.prefills[address] = p
        for d in self.decodes.values():
            d.on_finish = self._finished
        self.watches = StandInPrefills(self.clock, list(self.prefills.values()))
        self.router = Router(self.watches, self.router_index, None, load_weight=spec.load_weight,  # type: ignore[arg-type]
                             policy=spec.policy)
        self.requests: list[VRequest] = []

    # ---- a request's way -----------------------------------------------------------------------
    def _arrive(self, r: VRequest) -> None:
        r.ids = token_list(r.prompt)
        choice = self.router.decide(r.ids)
        if choice is None:
            r.error = "no prefill routable"
            return
        r.prefill = choice.address
        self.watches.watches[r.prefill].in_flight += 1
        self.prefills[r.prefill].arrive(r)

    def _first_token(self, r: VRequest) -> None:
        self.decodes[r.decode].join(r)

    def _finished(self, r: VRequest) -> None:
        self.watches.watches[r.prefill].in_flight -= 1
        prefill = self.prefills[r.prefill]
        prefill.finished(r)
        for p in self.prefills.values():  # a decode freed blocks: requests the Scheduler wants look again
            p.decode_freed()

    def _failed(self, r: VRequest) -> None:
        if r.decode:
            self.decodes[r.decode].cancel(r)
        self.watches.watches[r.prefill].in_flight -= 1
        self.prefills[r.prefill].finished(r)

    # ---- running it --------------------------------------------------------------------------
    def run(self, requests: list[VRequest]) -> dict:
        """Serve every request at its arrival; the run's facts (the results are each request's ``result()``)."""
        self.requests = requests
        for r in requests:
            self.clock.at(r.arrival, self._arrive, r)
        t0 = time.perf_counter()
        self.clock.run()
        wall = time.perf_counter() - t0
        return self.facts(wall)

    def facts(self, wall_s: float) -> dict:
        end = max((r.finish_at or r.arrival for r in self.requests), default=0.0)
        prompt = sum(r.n_prompt for r in self.requests) or 1
        engines = [p.engine for p in self.prefills.values()]
        return {"sim_duration_s": end, "wall_s": wall_s, "events": self.clock.events,
                "prefill_busy": [p.busy_s / end if end else 0.0 for p in self.prefills.values()],
                "decode_busy": [d.busy_s / end if end else 0.0 for d in self.decodes.values()],
                "decode_steps": sum(d.steps for d in self.decodes.values()),
                "prefill_cached_share": sum(r.prefill_cached for r in self.requests) / prompt,
                "prefill_prefix_hit_tokens": sum(e.prefix_hit_tokens() for e in engines),
                "decode_cached_share": sum(r.decode_cached_blocks * self.spec.block_size for r in self.requests)
                / prompt,
                "unfinished": sum(r.finish_at is None for r in self.requests),
                "left_in_engines": sum(e.num_requests() for e in engines)}


def token_list(prompt) -> list[int]:
    """A prompt's ids as a list (a ``BlockPrompt``'s bytes joined at C speed, not token by token)."""
    if isinstance(prompt, BlockPrompt):
        return list((b"".join(prompt.blocks) + prompt.tail)[: prompt.n])
    return list(prompt)
