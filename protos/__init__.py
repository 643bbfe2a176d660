"""gRPC contracts of pdserve (generated modules are committed; regenerate with `make protos`).

Read first: ``session.proto`` (the prefill <-> decode Session stream and load reports),
then ``generate.proto`` (the client Generate API). ``version.PROTOCOL_VERSION`` is the one
place the P/D protocol version is written.

- ``generate_pb2`` / ``generate_pb2_grpc``: ``Generator.Generate`` (server streaming)
- ``session_pb2`` / ``session_pb2_grpc``: ``Decode.Session`` (bidi), ``Decode.GetLoadReport``
- ``kv_events_pb2`` / ``kv_events_pb2_grpc``: ``KvEvents.Subscribe`` (server streaming: snapshot,
  then BlockStored/BlockRemoved/AllCleared stamped with epoch + seq), ``Snapshot``, ``GetLoad``
- ``kvpool_pb2`` / ``kvpool_pb2_grpc``: the distributed KV pool (kvpool/): ``GManager`` (reports,
  who has room, the debt ledger), ``KVLender`` (lend, put KV, micro-attention, release), ``KVNode``
"""

from .version import KV_EVENTS_VERSION, KVPOOL_VERSION, PROTOCOL_VERSION

__all__ = ["KV_EVENTS_VERSION", "KVPOOL_VERSION", "PROTOCOL_VERSION"]
