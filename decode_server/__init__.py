"""pdserve.decode_server: allocates KV on command, receives it layer by layer, joins the
request to its continuous batch and streams tokens back on the Session; serves load reports.

Reading path (in this order):
  ``session.py``  DecodeSession: the request lifecycle as a numbered list (admit -> allocate ->
                  transfer -> decode -> release), one instance per Session stream
  ``service.py``  DecodeService: the gRPC servicer (Session, GetLoadReport), engine adapters,
                  the live-session registry and the counters /health shows
  ``cli.py``      ``pdserve decode``: start-up wiring, /health /ready /metrics, drain on SIGTERM
"""
