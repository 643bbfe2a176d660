"""The figures of a router-scale run as lines of text (printed at its end; docs/benchmarks.md quotes them)."""

from __future__ import annotations

GIB = 2**30


def lines(doc: dict, output_tokens: float | None = None) -> list[str]:
    t = doc["target"]
    out = [f"target: {t['reuse']['rate_per_s']:.0f} req/s (64 prefills, with the trace's reuse), "
           f"{t['no_reuse']['rate_per_s']:.0f} req/s (without)"]
    for row in doc.get("index", []):
        out.append(f"index {row['blocks'] / 1e6:g}M blocks / {row['servers']} prefills: "
                   f"{row['index_bytes'] / GIB:.2f} GiB ({row['bytes_per_block']:.0f} B/block); events/s stored "
                   f"{row['stored_events_per_s']:.0f}, removed {row['removed_events_per_s']:.0f}, wire "
                   f"{row['wire_events_per_s']:.0f}; decisions' lookups {row['match_requests_per_s']:.0f} req/s; "
                   f"worst event {row.get('worst_event_ms', float('nan')):.1f} ms")
    for s in doc.get("serving", []):
        by = s["by_router"]
        for name in ("branch", "branch-asyncio", "baseline"):
            if name not in by:
                continue
            b = by[name]
            added = "; ".join(f"+{a['p50_ms']:.1f}/+{a['p99_ms']:.1f} ({a['router_p50_ms']:.1f}/"
                              f"{a['router_p99_ms']:.1f} vs {a['direct_p50_ms']:.1f}/{a['direct_p99_ms']:.1f})"
                              for a in b["added_ttft"])
            cpu = ", ".join(f"{c:.2f}" for c in b["cpu_ms_per_request"])
            marginal = ", ".join(f"{c['marginal_ms_per_request']:.2f}" for c in b["capacity"])
            cap = b.get("core_capacity_per_s")
            out.append(f"serving {s['prefills']} prefills ({s.get('evictions', 'per-block')} evictions), router "
                       f"{name}: CPU ms/request {cpu}, less its idle share {marginal} -> "
                       f"{cap if cap is not None else float('nan'):.0f} req/s per core (1-token responses; "
                       f"{b['core_capacity_per_s_1_token']:.0f} with the idle work amortized at the window's rate); "
                       f"added TTFT p50/p99 ms {added}")
            for r in b.get("residence", []):
                out.append("  " + residence_line(r))
        if s.get("hop"):
            h = s["hop"]
            out.append(f"serving {s['prefills']}: the extra hop alone (the same bodies to a server that does nothing, "
                       f"on the router's CPU): time to first byte p50/p99/max {_f(h['ttft_p50_ms'])}/"
                       f"{_f(h['ttft_p99_ms'])}/{_f(h['ttft_max_ms'])} ms")
        if "cpu_ratio_baseline_over_branch" in by:
            out.append(f"serving {s['prefills']}: router CPU per request, baseline / branch "
                       f"{by['cpu_ratio_baseline_over_branch']:.2f}x (less the idle share "
                       f"{by.get('marginal_ratio_baseline_over_branch', float('nan')):.2f}x; per round "
                       f"{', '.join(f'{r:.2f}' for r in by.get('marginal_ratios_per_round', []))})")
        b = by.get("branch", {})
        if "cpu_ms_per_event" in b and output_tokens:
            per_req = b["marginal_ms_per_request"] + b["cpu_ms_per_event"] * output_tokens
            out.append(f"serving {s['prefills']}: {b['cpu_ms_per_event'] * 1e3:.1f} us per relayed event; at the "
                       f"trace's mean {output_tokens:.0f} output tokens {per_req:.1f} ms/request -> "
                       f"{1e3 / per_req:.0f} req/s per core")
        sat = s.get("saturate")
        if sat:
            out.append(f"serving {s['prefills']} saturate: offered {sat['offered_per_s']:.0f} req/s, completed "
                       f"{sat['completed_per_s']:.0f} req/s, errors {sat['errors']}, router CPU "
                       f"{sat['router_cpu_util'] * 100:.0f}%")
    r = doc.get("restart")
    if r:
        u = r["under_load"]
        out.append(f"restart {r['blocks'] / 1e6:g}M blocks / {r['prefills']} prefills: first start synced in "
                   f"{r['first_start']['synced_s']:.1f} s (router RSS {r['router_rss_bytes'] / GIB:.2f} GiB); "
                   f"after SIGKILL ready in {u['restart']['ready_s']:.1f} s, index whole in "
                   f"{u['restart']['synced_s']:.1f} s; the new router's CPU until then "
                   f"{u['restart'].get('router_cpu_s', float('nan')):.1f} s, the fleet's "
                   f"{u.get('fleet_cpu_s', float('nan')):.1f} s")
        agree = u.get("index_after")
        if agree:
            out.append(f"  after the load: the new router's index agrees with {agree['agree']} of "
                       f"{agree['prefills']} stand-ins (epoch, last seq, blocks; {agree['index_blocks']} of "
                       f"{agree['blocks']} blocks) {agree['after_s']:.1f} s after it ended")
        for phase, p in u["phases"].items():
            out.append(f"  {phase}: sent {p['sent']}, ok {p['ok']}, errors {p['errors']} {p['error_kinds']}, "
                       f"TTFT p50 {p['ttft_p50_ms'] or float('nan'):.0f} ms")
    return out


def _f(x: float | None) -> str:
    return "nan" if x is None else f"{x:.2f}"


def residence_line(r: dict) -> str:
    """One window's router-own time per request (``residence.py``)."""
    t, q, a, o = r["total"], r["request_part"], r["response_part"], r["ttft_less_router"]
    body = r.get("body_part", {})
    tail = ", ".join(f"{x['ttft_ms']:.1f} ({x['router_ms']:.2f})" for x in r.get("ttft_tail", []))
    return (f"{r['via']} window: the router's own time per request ({r['requests']} requests) p50/p99/max "
            f"{_f(t['p50_ms'])}/{_f(t['p99_ms'])}/{_f(t['max_ms'])} ms, {r['over_target']} over "
            f"{r['target_ms']:g} ms (request part p50/p99 {_f(q['p50_ms'])}/{_f(q['p99_ms'])}, of it until the body "
            f"was read {_f(body.get('p50_ms'))}/{_f(body.get('p99_ms'))}, until the "
            f"prefill was chosen {_f(r['decided_part']['p50_ms'])}/{_f(r['decided_part']['p99_ms'])}; response part "
            f"{_f(a['p50_ms'])}/{_f(a['p99_ms'])}); TTFT less it p50/p99 {_f(o['p50_ms'])}/{_f(o['p99_ms'])} "
            f"({r['matched']} matched); the slowest TTFTs (the router's own ms): {tail}")
