"""The API key check: ``Authorization: Bearer KEY``, the scheme matched case-insensitively."""

from __future__ import annotations

import hmac


def bearer_ok(header: str, api_key: str) -> bool:
    """Whether an ``Authorization`` header value carries ``api_key`` as a bearer token. The scheme is
    case-insensitive (RFC 7235 §2.1: ``bearer KEY`` and ``BEARER KEY`` are ``Bearer KEY``); the key is
    compared in constant time and exactly (after the spaces around it)."""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())
