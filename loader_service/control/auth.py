"""The API token that guards mutating REST endpoints.

Resolution order: ``LOADER_API_TOKEN``; the file named by ``LOADER_API_TOKEN_FILE`` (a
Kubernetes Secret mounted as a file); else a random token made at start, written to a 0600
file whose path is logged (the token itself never is: logs are shipped to aggregators).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import tempfile
from typing import NamedTuple, Optional, Tuple

log = logging.getLogger("loader_service.control.auth")


class Token(NamedTuple):
    value: str
    source: str  # "LOADER_API_TOKEN", the token file, or "generated"
    generated_file: str = ""  # where a generated token was written (removed when the service stops)


def resolve_token(token: Optional[str], token_file: Optional[str]) -> Token:
    if token:
        return Token(token, "LOADER_API_TOKEN")
    if token_file:
        try:
            with open(token_file) as f:
                value = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the API token file {token_file}: {exc.strerror}") from None
        if not value:
            raise ValueError(f"the API token file {token_file} is empty")
        return Token(value, token_file)
    value = secrets.token_urlsafe(24)
    fd, path = tempfile.mkstemp(prefix="loader-api-token-")  # mode 0600, a name nobody else holds
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    log.warning("no API token configured (LOADER_API_TOKEN / LOADER_API_TOKEN_FILE); generated one for this run "
                "and wrote it to %s (mode 0600): LOADER_API_TOKEN_FILE=%s loader-service scale N", path, path)
    return Token(value, "generated", path)


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
