"""A dataset that changes under the service is named, never mixed into an epoch (round 3: a
service restarted on a folder with one file added finished the epoch with 689 files missing and
689 doubled, no error)."""

import os
import shutil
import urllib.request

import pytest

from client import LoaderError, RemoteLoader

from tests.conftest import write_imagefolder
from testkit.helpers import status, wait_for

# prefetch=1: after 2 batches taken, at most one more can be in flight, so the rest of the epoch
# must come from the restarted service (with the default window the whole epoch could already be here)
KW = dict(batch_size=4, image_size=32, seed=2, prefetch=1, epoch_lookahead=False, timeout=30)


def _stopped_mid_epoch(make_service, tmp_path):
    """A folder of 48 images, a service on it stopped after 2 batches of a live loader's epoch:
    (folder, port, loader, its iterator, the indices taken)."""
    folder = write_imagefolder(str(tmp_path / "data"), classes=3, per_class=16)
    first = make_service(data=(folder,), demo=False)
    ld = RemoteLoader(first.endpoint, **KW)
    it = iter(ld)
    got = [i for _ in range(2) for i in next(it).indices]
    first.stop()
    return folder, int(first.endpoint.rsplit(":", 1)[1]), ld, it, got


@pytest.mark.parametrize("change", ["add", "remove and add", "new class"])
def test_a_service_restarted_on_a_changed_folder_is_refused_by_the_live_loader(make_service, tmp_path, change):
    folder, port, ld, it, got = _stopped_mid_epoch(make_service, tmp_path)
    with ld:
        one = os.path.join(folder, "cls0", sorted(os.listdir(os.path.join(folder, "cls0")))[0])
        if change == "add":
            shutil.copyfile(one, os.path.join(folder, "cls1", "added.png"))
        elif change == "remove and add":
            shutil.copyfile(one, os.path.join(folder, "cls1", "added.png"))
            os.unlink(os.path.join(folder, "cls2", sorted(os.listdir(os.path.join(folder, "cls2")))[0]))
        else:
            os.mkdir(os.path.join(folder, "cls00"))  # later classes' labels shift by one
            shutil.copyfile(one, os.path.join(folder, "cls00", "x.png"))
        make_service(data=(folder,), demo=False, data_port=port)  # the same address
        with pytest.raises(LoaderError, match=r"the dataset changed: the service at tcp://127\.0\.0\.1:\d+ serves "
                                              r"'data' with \d+ samples .*this loader's epochs were planned on 48 "
                                              r"samples") as info:
            for b in it:
                got.extend(b.indices)
        assert info.value.code == "dataset_changed"
    assert len(got) == len(set(got))  # nothing doubled before the refusal


def test_a_restart_on_the_same_folder_resumes_exactly_once(make_service, tmp_path):
    folder, port, ld, it, got = _stopped_mid_epoch(make_service, tmp_path)
    with ld:
        for name in os.listdir(os.path.join(folder, "cls0")):  # touched, not changed: mtimes are no identity
            os.utime(os.path.join(folder, "cls0", name))
        make_service(data=(folder,), demo=False, data_port=port)
        got += [i for b in it for i in b.indices]
    assert sorted(got) == list(range(48))


def test_files_added_between_epochs_are_not_served_and_the_service_says_so(make_service, tmp_path, caplog):
    """The rescan policy: a changed folder is served after a restart, never mid-run; the watch
    (--watch; called by hand here) puts what changed in /v1/status and the log, once."""
    import logging

    caplog.set_level(logging.WARNING, logger="loader_service")
    folder = write_imagefolder(str(tmp_path / "data"), classes=3, per_class=4)
    svc = make_service(data=(folder,), demo=False, watch_s=0)
    svc.watch_datasets()
    ds = status(svc)["datasets"]["data"]
    assert (ds["length"], ds["changed_on_disk"], ds["on_change"]) == (12, None, "restart")
    with RemoteLoader(svc.endpoint, **KW) as ld:
        first = [i for b in ld for i in b.indices]
        one = os.path.join(folder, "cls0", sorted(os.listdir(os.path.join(folder, "cls0")))[0])
        shutil.copyfile(one, os.path.join(folder, "cls2", "late.png"))
        svc.watch_datasets()
        svc.watch_datasets()  # said once
        second = [i for b in ld for i in b.indices]  # the next epoch: the 12 samples of the index
    assert sorted(first) == sorted(second) == list(range(12))
    ds = status(svc)["datasets"]["data"]
    assert ds["fingerprint"] == ld._fingerprint and ds["length"] == 12
    assert ds["changed_on_disk"] == {"added": 1, "removed": 0, "relabelled": 0, "examples": ["+ cls2/late.png"],
                                     "message": "1 files added (e.g. + cls2/late.png)"}
    metrics = urllib.request.urlopen(svc.http_url + "/metrics", timeout=10).read().decode()
    assert 'loader_dataset_files_not_served{change="added",dataset="data"} 1.0' in metrics
    said = [r.getMessage() for r in caplog.records if "changed on disk" in r.getMessage()]
    assert said == ["dataset 'data' changed on disk since the service scanned it: 1 files added (e.g. + "
                    "cls2/late.png). They are not served: the index taken at the start is the dataset's "
                    "identity; restart the service to serve them (loaders in the middle of an epoch then stop "
                    "with [dataset_changed])"]


def test_the_watch_runs_on_its_interval(make_service, tmp_path):
    folder = write_imagefolder(str(tmp_path / "data"), classes=2, per_class=3)
    svc = make_service(data=(folder,), demo=False, watch_s=0.05)
    os.unlink(os.path.join(folder, "cls1", sorted(os.listdir(os.path.join(folder, "cls1")))[0]))
    wait_for(lambda: status(svc)["datasets"]["data"]["changed_on_disk"] is not None, what="the watch to see it")
    assert status(svc)["datasets"]["data"]["changed_on_disk"]["removed"] == 1
