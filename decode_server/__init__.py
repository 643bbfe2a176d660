"""pdserve.decode_server: allocates KV on command (reusing what its prefix cache holds of the
prompt), receives the rest layer by layer (or computes the prompt itself when prefill says
so), joins the request to its continuous batch and streams tokens back on the Session; serves
load reports and its prefix cache's KV events.

Reading path (in this order):
  ``session.py``          DecodeSession: the request lifecycle as a numbered list (admit -> allocate, reusing
                          the cached prefix -> transfer or compute the prompt here -> decode -> release), one
                          instance per Session stream, given SessionDeps
  ``session_stream.py``   SessionStream: writes with a timer, the reader of prefill's messages, waits that
                          end when prefill goes away
  ``admission.py``        which Starts are refused and why (pure: version, compat, draining, sizes)
  ``pooled_decode.py``    PooledDecode: a request served through the KV pool (--kv-pool: KV partly on
                          lenders, prompt computed here, greedy tokens from kvpool's pooled request)
  ``service.py``          DecodeService: the gRPC servicer (Session, GetLoadReport), load reports
                          and the counters /health shows; KvEvents (our prefix cache) on the same port
  ``decode_engine.py``    DecodeEngine: the engine calls a session makes (reserve, add_prefilled or
                          prefill_reserved, release), the measured speed of prompts computed here
  ``registry.py``         SessionRegistry: live sessions, the draining flag, recent layer arrivals
  ``session_metrics.py``  SessionMetrics: refusals, KV-in wait and bytes, block and request gauges
  ``cli.py``              ``pdserve decode``: the flags, drain on SIGTERM
  ``wiring.py``           DecodeServer: the parts of one decode process assembled; /health /ready /metrics;
                          ``build_service``: the DecodeService with the SessionDeps it hands every session
"""
