"""The default job a loader takes: the launcher's id (what the ranks of one training share)
followed by what tells the loader from the others of its rank (a digest of its JobSpec), so a
training loader and a validation loader in one rank are two jobs, and every rank of one loader
derives the same name, in any process. No service: construction connects to nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from client import RemoteLoader
from client.loader import default_job, spec_digest

ENDPOINT = "tcp://127.0.0.1:9"  # nothing listens: naming the job needs no connection
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LAUNCHER = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def torchrun(monkeypatch):
    for k in LAUNCHER:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")


def job_of(**kw) -> str:
    with RemoteLoader(ENDPOINT, **{"batch_size": 8, "world_size": 2, **kw}) as ld:
        return ld.config.job


def test_a_training_and_a_validation_loader_of_one_rank_are_two_jobs(torchrun):
    train = job_of(rank=0)
    val = job_of(rank=0, train=False, shuffle=False)
    assert train != val
    assert train.startswith("torchelastic:run-7/train-") and val.startswith("torchelastic:run-7/eval-")


def test_every_rank_of_one_loader_derives_the_same_job(torchrun):
    assert job_of(rank=0) == job_of(rank=1)
    assert job_of(rank=0, train=False) == job_of(rank=1, train=False)


@pytest.mark.parametrize("change", [
    dict(shuffle=False), dict(drop_last=True), dict(batch_size=16), dict(image_size=64), dict(seed=1),
    dict(world_size=4), dict(dataset="other"), dict(shuffle_window=4), dict(scale=(0.5, 1.0)),
    dict(pipeline="mine"), dict(pipeline="mine", pipeline_args={"size": 3}),
])
def test_any_setting_the_service_compares_makes_another_job(torchrun, change):
    assert job_of() != job_of(**change)


def test_equal_settings_written_differently_are_one_job(torchrun):
    assert job_of(scale=(0.08, 1)) == job_of(scale=[0.08, 1.0])
    assert job_of(pipeline="p", pipeline_args={"a": 1, "b": [1, 2]}) == \
        job_of(pipeline="p", pipeline_args={"b": [1, 2], "a": 1})


def test_the_launcher_part_follows_the_launcher(monkeypatch):
    for k in LAUNCHER:
        monkeypatch.delenv(k, raising=False)
    assert job_of() == ""  # outside a launcher: no job rules, as before
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert job_of().startswith("10.0.0.1:29500/train-")  # Lightning, accelerate
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # accelerate's torchrun: no run id
    assert job_of().startswith("10.0.0.1:29500/train-")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x" * 400)
    long = job_of()
    assert len(long) == 256 and re.fullmatch(r"torchelastic:x+/train-[0-9a-f]{12}", long)  # the wire's limit


def test_a_job_given_is_kept_as_given(torchrun):
    assert job_of(job="my-training") == "my-training"
    assert job_of(job="my-training", train=False) == "my-training"


def test_the_digest_is_the_same_in_another_process(torchrun):
    """Ranks are processes: the name must not depend on hash seeds or dict order."""
    with RemoteLoader(ENDPOINT, batch_size=8, train=False, pipeline="p", pipeline_args={"z": b"\x01", "a": 2.5}) as ld:
        here = spec_digest(ld.config.spec)
    code = ("from client import RemoteLoader; from client.loader import spec_digest\n"
            "ld = RemoteLoader('tcp://127.0.0.1:9', batch_size=8, train=False, pipeline='p', "
            "pipeline_args={'a': 2.5, 'z': b'\\x01'})\nprint(spec_digest(ld.config.spec)); ld.close()")
    env = dict(os.environ, PYTHONHASHSEED="123", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here and len(here) == 12


def test_default_job_without_a_spec_is_the_launchers_id(torchrun):
    assert default_job() == "torchelastic:run-7"
