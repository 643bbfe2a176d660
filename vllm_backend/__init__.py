"""pdserve.vllm_backend: vLLM as the engine of pdserve's prefill and decode servers
(``pdserve prefill|decode --engine vllm``), with pdserve's CacheStore as vLLM's KV connector.

Request lifecycle over P/D (the Session, picker, router and SLO code are the built-in engine's):
  1. decode: the Session's reserve adds a vLLM request whose prompt tokens past vLLM's prefix-cache
     hit are remote; vLLM's scheduler allocates their blocks (WAITING_FOR_REMOTE_KVS) and they are
     the Allocation (the hit's blocks first, not received);
  2. prefill: prefill_only adds a max_tokens=1 request; in the step that computes its prompt the
     worker connector's save_kv_layer hands each layer's blocks to the CacheStore, which pushes
     them straight from vLLM's KV memory into the decode's vLLM blocks;
  3. decode: add_prefilled writes the real prompt + the prefill's first token into the waiting
     request and reports the load done; vLLM computes the first token's KV and decodes;
  4. prefill: release once the KV is acked lets vLLM free the held blocks; decode: the request
     finishes (or is aborted) in vLLM, which frees its blocks.

Reading path:
  ``env.py``        where vLLM's environment is; re-running the command there (``bootstrap.py``)
  ``server.py``     the ServerParts of --engine vllm: vLLM built in-process, its KV memory as the region
  ``engine.py``     VllmAsyncEngine: the ServerEngine calls (engine/server_engine.py) mapped onto vLLM
  ``connector.py``  PdserveConnector (KVConnectorBase_V1): the scheduler and worker hooks
  ``bridge.py``     Bridge: the state those three share in the one process
  ``logprobs.py``   vLLM's per-token and prompt logprobs in the built-in engine's shape (TokenLogprob)
  ``kv_events.py``  VllmKvEvents: vLLM's prefix-cache events, re-hashed as routers and pickers hash prompts

Only ``connector.py``, ``engine.py`` and ``server.py`` import vllm; nothing outside this
package does (tests/unit/test_import_arrows.py). pdserve's own environment never installs vLLM.
"""
