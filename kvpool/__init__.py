"""pdserve.kvpool: a KV pool spread over several decodes (DistKV-LLM / DistAttention).

Request lifecycle (a request too long for one decode's KV pool):
1. The decode (the *borrower*) keeps what its free blocks hold, generated tokens included,
   and asks the gManager who has room for the rest (FindLenders: up to three live decodes,
   most lendable first).
2. It asks those rManagers in turn to lend blocks (Lend); each lends at most its free blocks
   minus its reserve, first come first served, and reports the loan to the gManager, whose
   debt ledger is the union of those reports (rebuilt by the next round after a restart).
3. Prefill runs on the borrower layer by layer; the overflow's KV goes to the lenders (PutKV).
4. Each decode step sends each layer's query to the lenders, which compute micro-attention
   over the blocks they hold (Attend: partial max, sum of exponentials, weighted values);
   the borrower merges them with its own part: equal to attention over the whole sequence.
5. When the request finishes or fails the borrower releases every loan (Release); lenders
   free loans whose borrower the gManager no longer lists, or that sat idle. A lender that
   dies fails only the requests that borrowed from it (LenderLost names it); its ledger row
   expires with its reports.

Reading path: ``attention.py`` (the merge math), ``ledger.py`` (the gManager's ledger),
``loans.py`` (a lender's loans, bounded by its reserve), ``rmanager.py`` (KVLender + the
Borrower), ``pooled.py`` (one pooled request), ``reporting.py`` (an rManager's reports to the
gManager), ``gmanager.py`` and ``node.py`` (the processes: ``pdserve kvpool gmanager|node``);
``engine_view.py`` and ``decode_pool.py`` (the pool inside a P/D decode: ``pdserve decode
--kv-pool``); the wire is ``protos/kvpool.proto``.

In P/D (``pdserve decode --kv-pool <gManager>``): the decode lends at most
``--kv-pool-lend-fraction`` of its blocks; a greedy request too big for its free blocks is
served pooled: its Allocation says ``pooled`` and lists where each part of the prompt's KV
lives (the decode's leading whole blocks, then each lender's, whose CacheStore receivers
expect them: ExpectKV), so the prefill computes the prompt and pushes every part straight to
its place (steps 2-3 become: the lenders confirm arrival, KVArrived; the decode steps start
from the prefill's first token). When not one whole prompt block fits beside the generated
tokens, the Allocation lists none: prefill answers ComputePrompt and the decode computes the
prompt as in step 3, putting the overflow on the lenders by PutKV. Its load reports carry the
pool's room so the prefills' pickers and the 413 check count it.

Not (yet) here: no DGFM debt-cycle defragmentation;
greedy sampling only on the pooled path (no logprobs, stop strings or grammar there); a
pooled request runs its own decode loop (one token at a time), not in the continuous batch.
"""
