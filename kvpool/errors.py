"""The KV pool's errors, torch-free: a decode's Session code catches them without loading the lender's parts."""

from __future__ import annotations


class LenderLost(RuntimeError):
    """A lender holding part of a request's KV did not answer: the request cannot go on."""
