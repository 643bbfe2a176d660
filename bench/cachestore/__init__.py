"""``pdserve bench cachestore``: layer-wise KV transfer between two processes against a raw socket
and a raw NIXL WRITE, measured in the same run.

Reading path: transfer.py (the command: the sending side, the figures), receiver_process.py (the
process it starts), peak_rss.py (peak memory and CPU time of one measurement), scheduler_mix.py
(``--mixed``: fifo vs priority). It imports the cachestore; the cachestore never imports it.
"""
