#!/usr/bin/env python3
"""tools/chaos_summary.py FULL.json OUT.json: keep a `pdserve bench chaos` run's JSON small enough for docs/: everything but the per-request list, plus
the failed requests' errors grouped (the full file stays where the bench wrote it)."""
import collections, json, sys
d = json.load(open(sys.argv[1]))
reqs = d.pop("requests")
errors = collections.Counter((r.get("error") or "")[:120] for r in reqs if r.get("outcome") != "completed")
d["requests_failed_errors"] = errors.most_common(15)
d["requests_count"] = len(reqs)
json.dump(d, open(sys.argv[2], "w"), indent=1)
