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
    """A request id the CacheStore has no entry for (never bound/expected, or already deleted).
    ``cause``: the error its entry failed with, when it failed (else None)."""

    cause: BaseException | None = None


class BindRefused(UnknownRequestError):
    """A BIND, DATA frame or NIXL notification for a live request carried another bind token than the
    one the receiver issued for it (``expect``): not from the prefill that owns the request's Session.
    Refused without touching the entry; the message names the request, never a token."""


CHECKSUM_MISMATCH = "kv_checksum_mismatch"  # the reason code the servers pass on (refusal / error code, metric label)


class ChecksumError(TransferError):
    """KV bytes arrived that do not match the checksum the sender computed over them.

    Raised on the receiver (the message names the request, the layer and the blocks) and on
    the sender (the receiver's ERROR for that request said so). The request's entry has
    been failed and freed like any other ``TransferError``; nothing of it was marked arrived.
    """

    code = CHECKSUM_MISMATCH

    def __init__(self, message: str, request_id: str | None = None, layer: int | None = None):
        super().__init__(message)
        self.request_id, self.layer = request_id, layer
