"""examples/train_ddp.py under torchrun: DDP ranks train on the service's batches, the job is
stopped mid-epoch and started again from its checkpoint; every sample of every epoch is trained
on exactly once across ranks and restarts. Works with 0, 1 or several GPUs: two ranks use one
GPU each where the machine has two, else the CPU (gloo); one rank uses the GPU where there is one."""

from testkit.paths import REPO_ROOT
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import DEMO_SIZE

ROOT = REPO_ROOT
SCRIPT = os.path.join(ROOT, "examples", "train_ddp.py")


def _example():
    spec = importlib.util.spec_from_file_location("train_ddp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("local_rank, local_world, gpus, device, backend", [
    (0, 1, 0, "cpu", "gloo"), (1, 2, 0, "cpu", "gloo"),
    (0, 1, 1, "cuda:0", "nccl"), (0, 2, 1, "cpu", "gloo"), (1, 2, 1, "cpu", "gloo"),  # never cuda:1 on one GPU
    (0, 2, 2, "cuda:0", "nccl"), (1, 2, 2, "cuda:1", "nccl"), (1, 2, 8, "cuda:1", "nccl"),
])
def test_each_rank_gets_its_own_gpu_or_every_rank_the_cpu(local_rank, local_world, gpus, device, backend):
    got_device, got_backend, why = _example().pick_device(local_rank, local_world, gpus)
    assert (str(got_device), got_backend) == (device, backend)
    assert bool(why) == (device == "cpu")


def torchrun(*args: str, nproc: int = 2) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), SCRIPT,
           *args]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)), start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            pytest.fail(f"torchrun did not finish in 300s:\n{out}")
    assert proc.returncode == 0, out
    return out


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [
    2, pytest.param(1, marks=[pytest.mark.cuda, pytest.mark.skipif(GPUS == 0, reason="needs an NVIDIA GPU")])])
def test_ddp_training_stopped_and_resumed_sees_every_sample_once_per_epoch(service, tmp_path, nproc):
    common = ["--endpoint", service.endpoint, "--epochs", "2", "--batch-size", "16", "--image-size", "32",
              "--checkpoint", str(tmp_path / "ckpt.pt"), "--checkpoint-every", "3",
              "--log-indices", str(tmp_path / "idx")]
    first = torchrun(*common, "--stop-after", "5", nproc=nproc)  # killed mid-epoch 0, after its checkpoint
    assert "stopping after step 5" in first
    for r in range(nproc):  # the device each rank should get on this machine
        device, backend, _ = _example().pick_device(r, nproc, GPUS)
        assert f"rank {r}: device {device}, backend {backend}" in first, first
    second = torchrun(*common, nproc=nproc)
    assert "resumed from" in second and "epoch 0, batch 5, step 5" in second
    assert "epoch 1:" in second

    ranks = range(nproc)
    rows = {r: [json.loads(line) for line in open(tmp_path / "idx" / f"rank{r}.jsonl")] for r in ranks}
    per_rank_batches = -(-DEMO_SIZE // nproc // 16)
    for epoch in (0, 1):
        got = [i for r in ranks for row in rows[r] if row["epoch"] == epoch for i in row["indices"]]
        assert sorted(got) == list(range(DEMO_SIZE)), f"epoch {epoch}: not every sample exactly once"
        for r in ranks:  # equal steps per rank, so DDP's collectives never wait on a missing one
            assert sum(row["epoch"] == epoch for row in rows[r]) == per_rank_batches
