"""pdserve.prefill_server: the front door. OpenAI HTTP + gRPC Generate; picks a decode,
prefills layer by layer while the CacheStore pushes each layer, relays decode's tokens.

Reading path (in this order):
  ``cli.py``                ``pdserve prefill``: the request lifecycle as a numbered list, start-up wiring
  ``node.py``               PrefillNode.generate: pick -> Session -> retry -> local fallback -> resume
  ``admission_queue.py``    AdmissionQueue: requests wait in line (FIFO, deadline, max length) while every decode is full
  ``decode_session.py``     SessionRunner: the prefill end of one Session stream (Start, Allocation, KV push, tokens)
  ``transfer_accounting.py`` TransferAccounting: picker accounting of allocations, transfer metrics
  ``picker.py``             DecodePicker: smooth weighted round robin on free KV bytes, or round robin
  ``load_poller.py``        polls each decode's LoadReport; one gRPC channel per decode
  ``frontend.py``           tokenize, SamplingParams, TextStream, per-request metrics (shared by both APIs)
  ``http_api.py``           aiohttp routes: /v1/completions, /v1/chat/completions, /v1/models, probes
  ``grpc_api.py``           Generator.Generate (server streaming)
  ``openai_api.py``         OpenAI request validation and response/SSE shapes (pure)
  ``text_stream.py``        token deltas -> text deltas with stop strings cut (pure)

Decode discovery lives in ``pdserve.discovery`` (static list or Kubernetes EndpointSlices).
"""
