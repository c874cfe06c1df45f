"""examples/train_ddp.py under torchrun: two DDP ranks (gloo, CPU) train on the service's batches,
the job is stopped mid-epoch and started again from its checkpoint; every sample of every epoch
is trained on exactly once across ranks and restarts."""

import json
import os
import subprocess
import sys

import pytest

from .conftest import DEMO_SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_ddp.py")


def torchrun(*args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT, *args]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            pytest.fail(f"torchrun did not finish in 300s:\n{out}")
    assert proc.returncode == 0, out
    return out


@pytest.mark.slow
def test_ddp_training_stopped_and_resumed_sees_every_sample_once_per_epoch(service, tmp_path):
    common = ["--endpoint", service.endpoint, "--epochs", "2", "--batch-size", "16", "--image-size", "32",
              "--checkpoint", str(tmp_path / "ckpt.pt"), "--checkpoint-every", "3",
              "--log-indices", str(tmp_path / "idx")]
    first = torchrun(*common, "--stop-after", "5")  # killed mid-epoch 0, after its checkpoint
    assert "stopping after step 5" in first
    second = torchrun(*common)
    assert "resumed from" in second and "epoch 0, batch 5, step 5" in second
    assert "epoch 1:" in second

    rows = {r: [json.loads(line) for line in open(tmp_path / "idx" / f"rank{r}.jsonl")] for r in (0, 1)}
    per_rank_batches = -(-DEMO_SIZE // 2 // 16)
    for epoch in (0, 1):
        got = [i for r in (0, 1) for row in rows[r] if row["epoch"] == epoch for i in row["indices"]]
        assert sorted(got) == list(range(DEMO_SIZE)), f"epoch {epoch}: not every sample exactly once"
        for r in (0, 1):  # equal steps per rank, so DDP's collectives never wait on a missing one
            assert sum(row["epoch"] == epoch for row in rows[r]) == per_rank_batches
