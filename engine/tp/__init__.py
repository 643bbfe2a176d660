"""Tensor parallelism for the built-in engine: one process per rank, torch.distributed between them
(gloo on CPU, NCCL for the model's collectives on CUDA).

Rank 0 is the engine the servers talk to: it owns the Scheduler, samples, and speaks to the world. Each
step it sends the step's ForwardBatch to the other ranks; every rank runs the same forward on its shard
of the weights and of the KV heads; rank 0 gets the whole vocabulary's logits and samples.

Reading path:
  ``shard.py``   Shard: which heads, MLP rows and vocabulary rows a rank holds; the checkpoint slices that
                 make them (the loader reads only those) and the rank's ModelConfig
  ``heads.py``   which KV heads each rank holds, and which prefill/decode TP sizes pair (torch-free: the
                 decode's admission check reads it)
  ``group.py``   TPGroup: the process groups, the step's broadcast, the all-reduce and the LM head's gather
                 (hooked on the projections: the model code is unchanged)
  ``ranks.py``   TensorParallelSteps: rank 0 starts the workers, sends each step, names a rank that died
  ``worker.py``  a worker rank's process: load its shard, then run each step until rank 0 stops
  ``rank_pools.py`` P/D, the per-rank push: every rank's pool in shared memory, mapped by rank 0, whose
                 server runs one CacheStore sender or receiver per rank on them: each rank's KV head shard moves
                 on its own link, straight from or into its pool (``heads.rank_sources``: who feeds whom)
  ``transfer.py`` P/D, the fallback (a peer that does not speak the per-rank push, heads that pair only
                 through rank 0, CUDA): KV through rank 0's transfer pool (every KV head of every block),
                 gathered from the ranks per layer, scattered to them on arrival
"""
