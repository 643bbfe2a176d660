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
Borrower), ``pooled.py`` (one pooled request), ``gmanager.py`` and ``node.py`` (the processes:
``pdserve kvpool gmanager|node``); the wire is ``protos/kvpool.proto``.

Not (yet) here: the decode server's Session path does not use the pool (a pooled request
enters through ``KVNode.Generate``); the prefill server does not place KV on lenders through
the CacheStore; no DGFM debt-cycle defragmentation; greedy sampling only on the pooled path.
"""
