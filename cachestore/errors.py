"""The errors the CacheStore raises. Every message names the request, the peer or the value at fault."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer for one request failed: peer gone, timeout, cancel, or a rejected frame.

    When a wait raises this, the request's entry (receiver) or transfer (sender) has
    already been freed; calling delete() afterwards is allowed and does nothing.
    """


class CompatError(TransferError):
    """The two peers cannot exchange KV: protocol version or compatibility hash differ.

    The message carries both sides' values (version, hash and the fields behind the hash).
    """


class ProtocolError(TransferError):
    """A frame on the wire is malformed (bad magic, version, type, length, or a truncated frame).

    The connection that carried it is closed; other connections keep being served.
    """


class UnknownRequestError(LookupError):
    """A request id the CacheStore has no entry for (never bound/expected, or already deleted)."""
