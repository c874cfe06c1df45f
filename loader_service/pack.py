"""``loader-service pack``: convert an ImageFolder into a packed format. (Being written.)"""


def add_pack_parser(sub) -> None:
    p = sub.add_parser("pack", help="convert an ImageFolder to webdataset shards, HDF5 or packed")
    p.add_argument("src")
    p.add_argument("dst")


def run_pack(args) -> int:
    raise SystemExit("loader-service pack: not implemented yet")
