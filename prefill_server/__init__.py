"""pdserve.prefill_server: the front door. OpenAI HTTP + gRPC Generate; picks a decode
(preferring one that holds the prompt's prefix), prefills layer by layer while the CacheStore
pushes each layer the decode lacks (or, by cost, has the decode compute the prompt), relays
decode's tokens.

Reading path (in this order):
  ``cli.py``                ``pdserve prefill``: the request lifecycle as a numbered list, the flags
  ``wiring.py``             PrefillServer: the parts of one prefill process assembled, started and stopped;
                            ``build_node``: the PrefillNode with its SessionRunner and Disaggregator
  ``node.py``               PrefillNode: what one prefill process owns (built parts); ``generate``, the entry of a request
  ``conductor.py``          RequestConductor: one request's turn in line -> pick -> Session -> retry / resume /
                            wait in line / local fallback / give up
  ``conductor_deps.py``     ConductorDeps: what every conductor is given (parts, routing settings, hooks)
  ``mid_stream_resume.py``  MidStreamResume: the policy when a decode fails a request mid-stream
  ``local_fallback.py``     LocalFallback: the policy when no decode serves it (the colocated engine)
  ``admission_queue.py``    AdmissionQueue: requests wait in line (FIFO, deadline, max length) while every decode is full
  ``decode_session.py``     SessionRunner: the prefill end of one Session stream (Start, Allocation, decide,
                            KV push or ComputePrompt, tokens)
  ``session_protocol.py``   its errors (Retryable, DecodeFailed), Delta, timings, config, message helpers
  ``disaggregator.py``      Disaggregator: where each prompt is computed, from what it measured
  ``cost_model.py``         the cost model behind it (pure)
  ``transfer_accounting.py`` TransferAccounting: picker accounting of allocations, measurements, transfer metrics
  ``picker.py``             DecodePicker: smooth weighted round robin on free KV bytes (preferring a decode
                            that holds the prompt's prefix), or round robin
  ``load_poller.py``        polls each decode's LoadReport; one gRPC channel per decode
  ``decode_index.py``       DecodeIndex: each decode's prefix cache, from its KV events
  ``frontend.py``           tokenize, SamplingParams, TextStream, per-request metrics (shared by both APIs)
  ``http_api.py``           aiohttp routes: /v1/completions, /v1/chat/completions, /v1/models, probes
  ``tokenizer_api.py``      GET /tokenizer: the model's tokenizer files, for a router that mounts no model
  ``tokenize_api.py``       POST /tokenize, /detokenize: vLLM's routes (a prompt's ids as the OpenAI routes compute them)
  ``grpc_api.py``           Generator.Generate (server streaming)
  ``openai_api.py``         OpenAI request validation and response/SSE shapes (pure)
  ``openai_numbers.py``     the table every number of a request is checked against (pure)
  ``errors.py``             BadRequest: an invalid request, wherever it is found (HTTP 400 / INVALID_ARGUMENT)
  ``openai_params.py``      prompts lists, n, echo, logprobs, response_format, tools (pure)
  ``choices.py``            a request's prompts x n choices run as sequences, merged into one stream
  ``openai_serving.py``     the choices as a whole response or SSE; ``openai_logprobs.py`` logprobs shapes
  ``resume.py``             streams a router can resume: token ids on events, the ``pdserve_resume`` field
  ``text_stream.py``        token deltas -> text deltas with stop strings cut (pure)

Decode discovery lives in ``pdserve.discovery`` (static list or Kubernetes EndpointSlices). The OpenAI
Batch API (/v1/files, /v1/batches) lives in ``pdserve.batch`` (``batch/``, docs/batch.md): the start-up
(``wiring.py``) mounts its routes on this server's HTTP port, and its lines run through this server's
``Frontend``.
"""  # noqa: E501
