"""CURVE key files: what a trainer and a service read to authenticate the data port.

Keys are zmq.auth certificates (``NAME.key`` public, ``NAME.key_secret`` secret + public), so
any ZeroMQ tool reads them. A keys directory holds the service's pair (``server.*``) and the
public key of every authorized client (``*.key`` other than ``server.key``); a trainer needs
``client.key_secret`` and ``server.key``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

import zmq
import zmq.auth

SERVER = "server"
CLIENT = "client"
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

def make_keys(directory: str, names: Tuple[str, ...] = (SERVER, CLIENT), force: bool = False) -> List[Path]:
    """Write a certificate pair per name into ``directory`` (made 0700 if new): ``NAME.key``
    (0644) and ``NAME.key_secret`` (0600). Refuses to replace an existing file unless
    ``force``. Returns the paths written."""
    for n in names:
        if not n or "/" in n or n.startswith(".") or n != n.strip():
            raise ValueError(f"invalid key name {n!r}: use a plain file name such as 'client' or 'trainer-a'")
    out = Path(directory)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    targets = [out / f"{n}{ext}" for n in names for ext in (".key", ".key_secret")]
    existing = [str(p) for p in targets if p.exists() or p.is_symlink()]
    if existing and not force:
        raise FileExistsError(f"refusing to overwrite {', '.join(existing)} (use --force to replace them; "
                              "clients holding the old keys are then refused)")
    # Written in a private temporary directory and moved into place: a secret is never
    # readable by others, not even between its creation and a chmod.
    tmp = tempfile.mkdtemp(prefix=".keys-", dir=out)
    try:
        for n in names:
            pub, sec = zmq.auth.create_certificates(tmp, n)
            os.chmod(pub, 0o644)
            os.chmod(sec, 0o600)
        for p in targets:
            os.replace(os.path.join(tmp, p.name), p)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return targets


def _read(path: Path) -> Tuple[bytes, Optional[bytes]]:
    if not path.is_file():
        raise FileNotFoundError(f"CURVE key {path} not found (make keys with: loader-service keys {path.parent})")
    try:
        return zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"cannot read the CURVE key {path}: {exc}") from None


def load_pair(path: Path) -> Tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file, with errors that name the file."""
    public, secret = _read(path)
    if not public or not secret:
        raise ValueError(f"{path} holds no secret key: is it a .key (public) file?")
    return public, secret


def load_public(path: Path) -> bytes:
    return _read(path)[0]
