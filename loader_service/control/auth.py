"""The API token that guards mutating REST endpoints.

Resolution order: ``LOADER_API_TOKEN``; the file named by ``LOADER_API_TOKEN_FILE`` (a
Kubernetes Secret mounted as a file); else a random token made at start, written to a 0600
file whose path is logged (the token itself never is: logs are shipped to aggregators).

A generated token's file is named after the service's REST port (``loader-api-token-8080`` in
the temp directory): one file per service, reused by the next service on that port (a restart
keeps the operator's ``LOADER_API_TOKEN_FILE`` valid, and a killed service leaves nothing
behind that the next one does not take over) and removed when the service stops. The file is
reused only if it is a regular file of this user with mode 0600; anything else at that name is
left alone and the token goes to a fresh file instead (named in the log).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import stat
import tempfile
from typing import NamedTuple, Optional, Tuple

log = logging.getLogger("loader_service.control.auth")


class Token(NamedTuple):
    value: str
    source: str  # "LOADER_API_TOKEN", the token file, or "generated"
    generated_file: str = ""  # where a generated token was written (removed when the service stops)


def resolve_token(token: Optional[str], token_file: Optional[str], port: int = 0, host: str = "") -> Token:
    """The token and where it came from; a generated one is kept in the file of the service on ``host:port``."""
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
    value, path, how = _generated(token_file_name(port, host))
    log.warning("no API token configured (LOADER_API_TOKEN / LOADER_API_TOKEN_FILE); %s %s (mode 0600, removed "
                "when the service stops). To scale: %s", how, path, scale_hint(path))
    return Token(value, "generated", path)


def token_file_name(port: int = 0, host: str = "") -> str:
    """The generated token's file for the service on ``host:port`` ('' when the port is chosen at start)."""
    if not port:
        return ""
    # a port on loopback or on every address is one service's: only other addresses can share it
    where = "" if host in ("", "0.0.0.0", "*", "::", "127.0.0.1", "localhost") else "".join(c if c.isalnum() else "_" for c in host) + "-"
    return os.path.join(tempfile.gettempdir(), f"loader-api-token-{where}{port}")


def _generated(path: str) -> Tuple[str, str, str]:
    """(token, its file, what was done): the token in ``path`` if that is this user's 0600 file, else a new one."""
    if path:
        value = read_own_token(path)
        if value:
            return value, path, "reusing the generated token in"
        value = secrets.token_urlsafe(24)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            log.warning("%s exists but is not this user's 0600 token file: left alone; remove it to have the "
                        "token kept there", path)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(value + "\n")
            return value, path, "generated one for this service and wrote it to"
    value = secrets.token_urlsafe(24)
    fd, path = tempfile.mkstemp(prefix="loader-api-token-")  # mode 0600, a name nobody else holds
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value, path, "generated one for this service and wrote it to"


def read_own_token(path: str) -> str:
    """The token in ``path`` if it is a regular 0600 file owned by this user (never through a link), else ''."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            return ""
        try:
            value = f.read(4096).strip()
        except (OSError, UnicodeDecodeError):
            return ""
    return value if value and len(value.split()) == 1 else ""


def in_container() -> str:
    """This container's name for ``docker exec`` (its hostname), or '' outside a container."""
    if not (os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv") or os.environ.get("container")):
        return ""
    return socket.gethostname()


def scale_hint(path: str) -> str:
    """A ``scale`` command that works where the operator is: here, or on the host of this container.
    ``loader-service scale`` on this machine, as this user, finds the file by itself (by the port
    of its --url); elsewhere LOADER_API_TOKEN_FILE names it."""
    here = "loader-service scale N (as this user on this machine; elsewhere with LOADER_API_TOKEN_FILE=%s)" % path
    name = in_container()
    if not name:
        return here
    return (f"{here}; from the host of this container: docker exec {name} loader-service scale N "
            f"(with Compose: docker compose exec loader loader-service scale N); to scale with loader-service "
            f"on the host itself, start the container with LOADER_API_TOKEN set and export it there too")


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
