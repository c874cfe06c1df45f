"""``loader-service keys DIR``: CURVE certificates for the data port (see curve.py)."""

from __future__ import annotations

import argparse
import os
import sys

from wire.keys import CLIENT, SERVER, make_keys


def add_keys_parser(sub) -> None:
    p = sub.add_parser(
        "keys", help="write CURVE keys for the data port (zmq.auth certificates)",
        description="Write server.key, server.key_secret, client.key and client.key_secret into DIR (secrets mode "
                    "0600). The service reads DIR (--curve-keys / LOADER_CURVE_KEYS) and admits every *.key in it; a "
                    "trainer needs client.key_secret and server.key (RemoteLoader(curve_keys=DIR) / "
                    "LOADER_CURVE_KEYS). --client NAME adds one more client key to an existing DIR.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--client", metavar="NAME", action="append",
                   help="only add the client key NAME (NAME.key, NAME.key_secret); repeatable")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--force", action="store_true", help="replace existing key files (their holders are refused)")
    g.add_argument("--if-missing", action="store_true",
                   help="keys already there: keep them and succeed (for a one-shot container on every start)")


def run_keys(args) -> int:
    names = tuple(args.client) if args.client else (SERVER, CLIENT)
    if args.if_missing:
        there = [os.path.exists(os.path.join(args.dir, f"{n}{ext}")) for n in names for ext in (".key", ".key_secret")]
        if all(there):
            print(f"keys already in {args.dir}: kept", file=sys.stderr)
            return 0
        if any(there):
            print(f"loader-service keys: {args.dir} holds only some of the key files; fix it by hand or use --force",
                  file=sys.stderr)
            return 1
    try:
        written = make_keys(args.dir, names, force=args.force)
    except (FileExistsError, ValueError, OSError) as exc:
        print(f"loader-service keys: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    if args.client:
        print(f"service: picks the new key up at the next handshake (no restart). Trainer: copy "
              f"{args.dir}/{names[0]}.key_secret as client.key_secret, with server.key, into its keys directory.",
              file=sys.stderr)
    else:
        print(f"service: --curve-keys {args.dir}   trainer: RemoteLoader(..., curve_keys=DIR) or LOADER_CURVE_KEYS=DIR "
              "with client.key_secret and server.key. Keep *.key_secret private.", file=sys.stderr)
    return 0
