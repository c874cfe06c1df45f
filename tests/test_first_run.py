"""First-run rules: a user's dataset is never shadowed by the demo, and the demo set made
beforehand (the service image's) is opened instead of generated."""

import logging
import os

from client import RemoteLoader
from loader_service.sources import demo

from .conftest import write_imagefolder
from .helpers import collect, indices_of


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
