"""pdserve.router: the front door when there are several prefills. Each request goes to the
prefill that already holds most of its prompt's KV (a prefix index kept from the prefills'
KV events), weighed against load; the response is relayed byte for byte.

Request lifecycle on the router:

1. **accept** - HTTP /v1/completions or /v1/chat/completions (or gRPC Generate with
   ``--grpc-port``); the body is read, not validated (the prefill validates it; its 400 or
   INVALID_ARGUMENT comes back unchanged).
1b. **queue** (with SLO classes or ``--queue-policy``) - its SLO class (400 if unknown), early
   rejection (429), then the router's SLO line while every prefill is queueing, in the
   policy's order (``slo_gate.py``; 504 at its deadline).
2. **hash** - the prompt is tokenized as the prefill will (chat template, then encode) and its
   reusable full blocks are hashed with the engine's chained hashes (``prompt.py``).
3. **choose** - for every routable prefill (fresh ready load report): how many leading blocks
   the index says it holds, its requests in flight, its free blocks; ``choice.choose`` picks the
   cheapest (tokens to compute + load weight x in flight), ties by rendezvous hash. The
   decision and its reason (single|prefix|load|balance) are a metric label. ``--policy
   round-robin`` takes the prefills in turn instead (the experiments' baseline).
4. **relay** - ``relay.py`` (rank -> try prefill -> stream / retry next / resume after death / give
   up), the same for both doors: the body goes to that prefill's HTTP API untouched (gRPC: the
   request message to its Generate); status, content type and body (SSE chunks as they come;
   responses one by one) go back. A prefill that refuses the connection: the next in the ranking
   (``--max-attempts``); none: 503. A prefill that fails before any event reached the client: the
   request goes whole to the next one; after: the stream is resumed on another prefill
   (``resume.py``; gRPC: ``resume_token_ids``), else it ends with an SSE error event and ``[DONE]``
   (gRPC: the broken prefill's status, saying why) -- never a stream that just stops.
5. **release** - the end of the relay (or the client leaving, which closes the upstream
   connection so the prefill cancels) drops the request's in-flight counts.

Meanwhile, per prefill (``prefill_watch.py``): a KV-event stream (snapshot, then
BlockStored/BlockRemoved/AllCleared with epoch + seq) keeps the index; a gap or a new epoch
means resubscribe for a snapshot; a broken stream forgets the prefill's hashes at once; a
prefill gone from discovery leaves the index at once (``prefills.py``). Load is polled (the
watches' polls spread over the interval).

Reading path (in this order):
  ``cli.py``            ``pdserve router``: flags, start-up wiring, drain
  ``relay.py``          Relay: one request's ranking, attempts, resumes and in-flight counts (both doors)
  ``http_api.py``       RouterApi: the routes and the byte-for-byte relay
  ``resume.py``         EventRelay, resume: an HTTP stream whose prefill died, continued on another
  ``residence.py``      the router's own time per request on the way to its first byte (a metric, /debug/residence)
  ``grpc_api.py``       RouterGenerateServicer: gRPC Generate, relayed response by response (and resumed)
  ``slo_gate.py``       SloGate: the global SLO queue in front of the prefills (pdserve.slo's GlobalQueue)
  ``router.py``         Router.decide: prompt hashes + index + loads -> choice
  ``choice.py``         choose(): cost, tie-break, reason (pure)
  ``prefill_watch.py``  PrefillWatch: one prefill's event stream (``pdserve/kv_follow.py`` into a
                        ``pdserve/kv_index.py`` PrefixIndex, shared with the prefills) and load polls
  ``prefills.py``       PrefillSet: discovery -> watches; removal drops index entries
  ``prompt.py``         prompt token ids and block hashes from a request body
  ``prefill_tokenizer.py`` PrefillTokenizer: the tokenizer files from a prefill (``--tokenizer-from-prefill``)

The publishing end of KV events is ``pdserve/kv_events.py`` (served on each prefill's gRPC port).
"""
