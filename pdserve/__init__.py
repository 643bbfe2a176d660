"""pdserve: LLM serving with prefill/decode disaggregation on Kubernetes.

Reading path (see also README.md and each package's __init__):

- ``pdserve.engine``          the model runtime both servers share (start with engine/__init__.py)
- ``pdserve.cachestore``      layer-wise KV transfer between processes (cachestore/README.md)
- ``pdserve.protos``          gRPC contracts (protos/*.proto)
- ``pdserve.prefill_server``  the front door: OpenAI HTTP + gRPC, decode picking, KV push
- ``pdserve.decode_server``   receives KV, continuous-batch decodes, streams tokens back
- ``pdserve.router``          the front door before several prefills: prefix-aware routing (router/__init__.py)
- ``pdserve.operator``        kopf operator for the InferenceService CRD
- ``pdserve.cli``             the ``pdserve`` command
- ``pdserve.defaults``        ports and other facts every part agrees on
- ``pdserve.kv_events``       KV events of a server's prefix cache (epoch + seq), streamed to routers and prefills
- ``pdserve.kv_index``        the receiving end: PrefixIndex (pure), fed by ``pdserve.kv_follow``
- ``pdserve.chat_prompt``     the chat-to-prompt rule the prefill tokenizes by and the router hashes by
- ``pdserve.http_auth``       API keys at the OpenAI doors (router, prefill, batch server); the key file: ``api_keys``
"""

__version__ = "0.1.0"
