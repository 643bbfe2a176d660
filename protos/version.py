"""The P/D protocol version: the one place it is written.

Prefill sends it in ``Start``; decode puts it in every ``LoadReport``. A prefill only
routes to decodes whose reported version equals its own, and a decode refuses a
``Start`` that carries another version. Bump it whenever a message in session.proto
changes meaning (adding an optional field that old peers may ignore does not need a bump).
"""

# 2: Allocation.cached_blocks (decode-side prefix reuse: block_ids cover only the prompt blocks
#    after the cached ones), Start.reuse_prefix, ComputePrompt (the decode computes the prompt).
# 3: Sampling.logprobs and Sampling.grammar (a decode that ignored them would sample unconstrained
#    tokens without logprobs), FirstToken.logprob, Tokens.logprobs.
# 4: Allocation.kv_token and PoolTarget.kv_token (the CacheStore refuses KV without the decode's bind
#    token: a prefill that sent none would have every transfer refused).
#    (not bumped: Compat.tensor_parallel_size, field 9, an optional field old peers ignore: a TP server's blocks
#    on the wire hold every KV head, as a TP 1 server's, so an older TP 1 peer pairs with it unchanged; an older
#    peer's 0 reads as 1. The CacheStore's WIRE_VERSION is not bumped either: CompatInfo's head range is in
#    the compat hash only for a region with part of the heads, which only the per-rank push's senders and
#    receivers register, offered only to a peer whose Compat.kv_push says it speaks it: KV_PUSH_VERSION.)
PROTOCOL_VERSION = 4

# The per-rank KV push (engine/tp/heads.py rank_sources; docs/design.md "CacheStore contract"): each prefill
# rank pushes its own KV head shard straight to the decode ranks holding those heads, one CacheStore receiver
# per decode rank (Allocation.rank_targets). Each end says the version it speaks in Compat.kv_push; the decode
# offers rank targets only when the prefill's equals this, else the whole heads go through rank 0 (the gather
# path, engine/tp/transfer.py), so PROTOCOL_VERSION is unchanged (an older peer sends and reads 0). Bump it when
# what a rank target means changes.
# 1: a rank target takes whole blocks of one decode rank's head range, sent by a prefill rank holding exactly
#    that range (equal shards, or replicated KV heads).
# 2: a rank target is a piece (heads.rank_pieces): RankTarget.prefill_rank, first_kv_head and num_kv_heads name
#    its sender and heads, and every nesting pairing is served: a slice of a prefill rank's shard is packed
#    contiguous before it is sent (TP 1 into TP 2 on 2 KV heads), several prefill ranks' shards land in staging
#    pools of a decode rank and are unpacked into its pool (TP 2 into TP 1); engine/tp/pieces.py. The CacheStore's
#    wire is unchanged (a piece is whole blocks of a region holding exactly its heads). A decode still offers a
#    version-1 prefill its whole-shard pairings; a server whose pools are on a GPU says 1 (no slices there). A
#    version-1 decode offers a version-2 prefill nothing (it takes only its own version): rank 0's gather path.
KV_PUSH_VERSION = 2

# The KV-event stream (kv_events.proto): a router uses the index of a server only when the
# server's SNAPSHOT carries this version. Bump it when an event's meaning changes.
KV_EVENTS_VERSION = 1

# The KV pool (kvpool.proto): a gManager ignores reports, and a lender refuses loans, that carry
# another version. Bump it when a kvpool message changes meaning.
# 2: ExpectKVReply.kv_token (the lender's bind token, passed on to the prefill).
KVPOOL_VERSION = 2
