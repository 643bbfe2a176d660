"""PrefixIndex lives in the shared runtime now (``pdserve/kv_index.py``): prefills keep one of
their decodes too. Re-exported here so the router's imports stay as they were."""

from pdserve.kv_index import CLEARED, REMOVED, RESYNC_VERDICTS, STORED, PrefixIndex, ServerView

__all__ = ["CLEARED", "REMOVED", "RESYNC_VERDICTS", "STORED", "PrefixIndex", "ServerView"]
