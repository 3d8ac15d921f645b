"""Adapter errors: one class for "this adapter is invalid", one for "it is not there"."""
from __future__ import annotations


class AdapterError(ValueError):
    """The adapter cannot be served; the message says exactly what is wrong (HTTP 400)."""


class AdapterNotFoundError(AdapterError):
    """The adapter's local path or Hub repo cannot be found (HTTP 404)."""
