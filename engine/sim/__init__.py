"""The simulated engine (``--engine sim``): the built-in engine's scheduling with a profile's time, no model.

A request's lifecycle, as in the built-in engine (only step 3 differs):

1. admitted by the real ``EngineCore`` (``engine_core.py``): validated, queued in the real Scheduler;
   a P/D prefill (``pd.add_remote``) or decode reservation (``pd.reserve``/``reserve_prefix``) as usual;
2. scheduled: blocks from the real BlockManager (prefix-cache hits, LRU eviction, KV events), chunked
   prefill under the step's token budget, decode rows batched, preemption when blocks run out;
3. computed by ``SimRunner`` (``runner.py``): the step sleeps the profile's modelled seconds for its
   prefill chunks ``(new, cached)`` and decode rows ``(context)``, layer by layer, calling the P/D
   push's ``on_layer`` after each layer as the model does (the CacheStore moves the blocks' bytes);
   its tokens are a hash of each sequence's context, so P/D and colocated give the same text;
4. finished by the real OutputProcessor (stop strings, ``max_tokens``; never EOS), its blocks freed or
   held (a P/D prefill until ``release``), exactly as the built-in engine.

The servers wrap ``SimEngine`` in the same ``AsyncLLMEngine`` (``async_engine.py``): the Session,
picker, SLO queue and KV events are unchanged. Nothing here imports torch or numpy.

Reading path: ``profile.py`` (the JSON format and the step-time function), ``runner.py``, ``engine.py``,
``fit.py`` (fitting a profile to measured steps). Profiles shipped: ``profiles/*.json`` (each says where
it was measured). Measuring one: ``pdserve bench sim-profile`` (``bench/sim_profile.py``).
"""
