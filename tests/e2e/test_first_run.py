"""First-run rules: a user's dataset is never shadowed by the demo, and the demo set made
beforehand (the service image's) is opened instead of generated."""

import logging
import os

from client import RemoteLoader
from loader_service.sources import demo

from tests.conftest import write_imagefolder
from testkit.helpers import collect, indices_of


def test_demo_is_not_served_beside_a_users_dataset(make_service, tmp_path, caplog):
    """LOADER_DEMO=1 (compose's default) with a dataset given: only the dataset is served, and a
    client that names no dataset gets exactly its samples."""
    root = write_imagefolder(str(tmp_path / "mine"), classes=3, per_class=5, png_every=0)
    with caplog.at_level(logging.INFO, logger="loader_service"):
        svc = make_service(demo=True, data=(root,))
    assert list(svc.sources) == ["mine"]
    assert "demo dataset not served: datasets are given" in caplog.text
    with RemoteLoader(svc.endpoint, batch_size=4, image_size=24, seed=3) as ld:
        batches = collect(ld)
    assert sorted(indices_of(batches)) == list(range(15))
    labels = {i: lab for b in batches for i, lab in zip(b["indices"], b["labels"])}
    assert [labels[i] for i in range(15)] == [i // 5 for i in range(15)]


def test_builtin_demo_set_is_opened_not_generated(tmp_path, monkeypatch):
    built = tmp_path / "builtin"
    demo.ensure_demo(12, base=str(built), quiet=True).close()
    assert os.path.exists(os.path.join(demo.demo_path(12, 0, str(built)), "meta.json"))
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOADER_CACHE_DIR", str(cache))
    monkeypatch.setenv(demo.BUILTIN_ENV, str(built))
    src = demo.ensure_demo(12, quiet=True)
    try:
        assert src.path == demo.demo_path(12, 0, str(built)) and len(src) == 12
    finally:
        src.close()
    assert not cache.exists(), "nothing generated into the cache"
    # another size is not built in: generated into the cache as before
    other = demo.ensure_demo(7, quiet=True)
    try:
        assert other.path == demo.demo_path(7) and other.path.startswith(str(cache))
        assert other.labels.tolist() == [i % demo.NUM_CLASSES for i in range(7)]
    finally:
        other.close()


def test_a_port_in_use_or_a_foreign_host_is_one_clear_line_and_exit_2(demo_source, capsys):
    """The first thing that goes wrong on a shared machine: the port is taken. One line saying
    which port and what to change, exit 2, no traceback; in-process, nothing is left open."""
    import signal
    import socket
    import threading

    import pytest

    from loader_service.cli.main import main as cli_main
    from loader_service.config import ServiceConfig
    from loader_service.service import Service

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    threads = set(threading.enumerate())
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}  # serve installs its own
    try:
        for ports, line in (
            ((port, 0), f"loader-service: cannot bind the data port 127.0.0.1:{port}: Address already in use (another "
                        "process listens there: choose another port with --data-port / LOADER_DATA_PORT, or 0 for "
                        "any free one)"),
            ((0, port), f"loader-service: cannot bind the REST port 127.0.0.1:{port}: Address already in use (another "
                        "process listens there: choose another port with --http-port / LOADER_HTTP_PORT, or 0 for "
                        "any free one)"),
        ):
            code = cli_main(["serve", "--demo", "--demo-size", "64", "--host", "127.0.0.1", "--data-port",
                             str(ports[0]), "--http-port", str(ports[1])])
            err = capsys.readouterr().err
            assert code == 2 and err.strip().splitlines()[-1] == line and "Traceback" not in err
        for kw in ({"data_port": port}, {"http_port": port}, {"host": "10.255.255.1"}):
            cfg = dict(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=1)
            cfg.update(kw)
            with pytest.raises(OSError, match="cannot bind the (data|REST) port"):
                Service(ServiceConfig(**cfg), sources={"demo": demo_source}).start()
        assert set(threading.enumerate()) <= threads  # no ZAP, dispatcher or HTTP thread left behind
    finally:
        taken.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
