"""The API token that guards mutating REST endpoints.

Resolution order: ``LOADER_API_TOKEN``; the file named by ``LOADER_API_TOKEN_FILE`` (a
Kubernetes Secret mounted as a file); else a random token made at start and logged once.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from typing import Optional, Tuple

log = logging.getLogger("loader_service.auth")


def resolve_token(token: Optional[str], token_file: Optional[str]) -> Tuple[str, str]:
    """Returns (token, where it came from)."""
    if token:
        return token, "LOADER_API_TOKEN"
    if token_file:
        try:
            with open(token_file) as f:
                value = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the API token file {token_file}: {exc.strerror}") from None
        if not value:
            raise ValueError(f"the API token file {token_file} is empty")
        return value, token_file
    value = secrets.token_urlsafe(24)
    log.warning("no API token configured (LOADER_API_TOKEN / LOADER_API_TOKEN_FILE); generated one for this "
                "run: %s", value)
    return value, "generated"


def check_bearer(header: Optional[str], token: str) -> Optional[Tuple[int, str]]:
    """None if ``header`` carries the token; else (HTTP status, reason)."""
    if not header:
        return 401, "missing Authorization header; send 'Authorization: Bearer <token>'"
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return 401, "Authorization must be 'Bearer <token>'"
    if not hmac.compare_digest(value.strip().encode(), token.encode()):
        return 403, "wrong API token"
    return None
