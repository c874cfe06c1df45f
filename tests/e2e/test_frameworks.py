"""The training-framework examples (examples/train_torchrun.py, train_lightning.py,
train_accelerate.py) run for real, on the CPU, against a service started by the test: a job
is SIGKILLed as a whole (the launcher and every rank) mid-epoch, some steps after a checkpoint, and resumed from that
checkpoint, at the same or another world size; every sample of the epoch must have been
trained on exactly once, counting for the killed run only the steps up to the checkpoint
(what it trained after that is lost with the kill and must be served again).

How the tests know: each rank of each run logs the dataset indices of every step it trained
(examples/framework_common.py, ``--log-indices``), steps numbered across the resume, and a
resumed run logs the step it resumed from. Padding (the samples a rank repeats to even out
the ranks, ``batch.padding``) is left out of the log; the sizes are also chosen so that none
is needed: 240 samples, 8 per batch, checkpoints every 6 steps, so a fresh epoch divides
evenly over 1, 2 or 3 ranks and so does what is left after 6 steps of 2 ranks (240 - 96 = 144
= 6 x 24).

The loader states a checkpoint holds are rank 0's (the way real trainings checkpoint); a
resume on other ranks or at another world size needs the job-level ("elastic") loader state
of issue 27 (a position in the epoch's global order, loadable on any rank at any world size).
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter

import psutil
import pytest
import torch

from tests.conftest import DEMO_SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
RUN_TIMEOUT_S = 240  # one launch; a launch on the loaded 2-core CI machine takes 10-30 s
BATCH, CKPT_EVERY, HANG_AFTER = 8, 6, 8  # checkpoint at step 6, killed after step 8: steps 7-8 are lost

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


# ---------------------------------------------------------------------------------------- running


def _env() -> dict:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    # no launcher variables of an enclosing job: each launch is a training of its own
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "LOCAL_RANK"))}
    return dict(env, PYTHONPATH=path, OMP_NUM_THREADS="1")


def launch(cmd: list, out_path, *, hang_ranks: int = 0, log_dir=None, env=None) -> str:
    """Run ``cmd`` (a launcher and its processes, in a session of their own) to its end, or,
    with ``hang_ranks``, until that many ranks logged that they hang after ``--hang-after``:
    then SIGKILL the whole group, as when a job is killed. Returns its output."""
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(_env(), **(env or {})), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if hang_ranks and len(_hung(log_dir)) >= hang_ranks:
                kill_job(proc)
                return open(out_path).read()
            time.sleep(0.2)
        if proc.poll() is None:
            pytest.fail(f"{cmd[:4]}... did not finish in {RUN_TIMEOUT_S}s:\n{open(out_path).read()[-6000:]}")
    finally:
        if proc.poll() is None:
            kill_job(proc)
    output = open(out_path).read()
    if hang_ranks:
        pytest.fail(f"it exited ({proc.returncode}) before {hang_ranks} rank(s) hung:\n{output[-6000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{output[-6000:]}"
    return output


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it at once. Not just its process group:
    torchrun starts each worker in a session of its own, and a worker whose launcher is gone
    would go on (hanging, here) outside this test's view."""
    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(procs[1:], timeout=30)


def _hung(log_dir) -> set:
    hung = set()
    for path in glob.glob(os.path.join(str(log_dir), "*.jsonl")):
        if any(row.get("event") == "hang" for row in _rows(path)):
            hung.add(path)
    return hung


def _rows(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]  # a killed writer's last line may be cut


def torchrun(nproc: int, *args, extra=()) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *extra,
            os.path.join(EXAMPLES, "train_torchrun.py"), *args]


def lightning(devices: int, *args) -> list:
    return [sys.executable, os.path.join(EXAMPLES, "train_lightning.py"), "--devices", str(devices), *args]


def accelerate(nproc: int, *args) -> list:
    # several local processes: accelerate's torchrun-based launcher (--multi_gpu; the script's --cpu makes
    # them gloo ranks on the CPU); one process: the plain launcher (--multi_gpu refuses fewer than 2)
    how = ["--multi_gpu", "--main_process_port", "0"] if nproc > 1 else ["--cpu"]
    return [sys.executable, "-m", "accelerate.commands.launch", *how, "--num_processes", str(nproc),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            os.path.join(EXAMPLES, "train_accelerate.py"), "--cpu", *args]


def common(service, log_dir, epochs: int = 1) -> list:
    return ["--endpoint", service.endpoint, "--epochs", str(epochs), "--batch-size", str(BATCH),
            "--image-size", "32", "--checkpoint-every", str(CKPT_EVERY), "--log-indices", str(log_dir)]


# ---------------------------------------------------------------------------------------- counting


def attempts(*log_dirs) -> list:
    """The attempts of a training in order (each run's folder in turn, torchrun's restarts
    within it): ``[{"ranks": {rank: rows}, "start": {rank: start row}}, ...]``."""
    out = []
    for d in log_dirs:
        by_attempt = {}
        for path in sorted(glob.glob(os.path.join(str(d), "attempt*-rank*.jsonl"))):
            a, r = map(int, re.fullmatch(r"attempt(\d+)-rank(\d+)\.jsonl", os.path.basename(path)).groups())
            rows = _rows(path)
            assert rows and rows[0].get("event") == "start", f"{path}: no start row"
            entry = by_attempt.setdefault(a, {"ranks": {}, "start": {}})
            entry["start"][r] = rows[0]
            entry["ranks"][r] = [row for row in rows[1:] if "event" not in row]
        out += [by_attempt[a] for a in sorted(by_attempt)]
    return out


def resumed_from(attempt: dict) -> int:
    steps = {row["resumed_from"] for row in attempt["start"].values()}
    assert len(steps) == 1, f"the ranks of one attempt resumed from different steps: {steps}"
    return steps.pop()


def trained(*log_dirs) -> dict:
    """{epoch: Counter of sample ids trained on} over all attempts, keeping of each attempt
    only the steps up to the checkpoint the next one resumed from."""
    runs = attempts(*log_dirs)
    counts = {}
    for i, run in enumerate(runs):
        keep_to = resumed_from(runs[i + 1]) if i + 1 < len(runs) else float("inf")
        assert keep_to is not None, f"attempt {i + 1} started from scratch instead of resuming"
        for rows in run["ranks"].values():
            for row in rows:
                if row["step"] <= keep_to:
                    counts.setdefault(row["epoch"], Counter()).update(row["indices"])
    return counts


def assert_exactly_once(counts: dict, epochs: int = 1) -> None:
    assert sorted(counts) == list(range(epochs)), f"epochs trained: {sorted(counts)}"
    for epoch, c in counts.items():
        missing = sorted(set(range(DEMO_SIZE)) - set(c))
        twice = sorted(i for i, n in c.items() if n > 1)
        extra = sorted(set(c) - set(range(DEMO_SIZE)))
        assert not (missing or twice or extra), (f"epoch {epoch}: {len(missing)} samples never trained on "
                                                 f"{missing[:20]}, {len(twice)} more than once {twice[:20]}, "
                                                 f"{len(extra)} not in the dataset")


def assert_killed_after_checkpoint(killed_log, resumed_log, ckpt_step: int) -> None:
    """The killed run trained past its checkpoint (so something was lost), and the resumed one
    started from that checkpoint."""
    first, second = attempts(killed_log), attempts(resumed_log)
    assert max(row["step"] for rows in first[-1]["ranks"].values() for row in rows) == HANG_AFTER
    assert ckpt_step == CKPT_EVERY < HANG_AFTER
    assert resumed_from(second[0]) == ckpt_step


# ---------------------------------------------------------------------------------------- torchrun


def _torchrun_kill_and_resume(service, tmp_path, first: int, second: int, loader_state: str) -> None:
    args = ["--checkpoint", str(tmp_path / "ckpt.pt"), "--loader-state", loader_state]
    launch(torchrun(first, *common(service, tmp_path / "run1"), *args, "--hang-after", str(HANG_AFTER)),
           tmp_path / "run1.out", hang_ranks=first, log_dir=tmp_path / "run1")
    ckpt = torch.load(tmp_path / "ckpt.pt", map_location="cpu", weights_only=False)
    assert ckpt["world_size"] == first
    out = launch(torchrun(second, *common(service, tmp_path / "run2"), *args), tmp_path / "run2.out")
    assert f"step {CKPT_EVERY} (saved by {first} rank(s), resumed by {second})" in out, out
    assert_killed_after_checkpoint(tmp_path / "run1", tmp_path / "run2", ckpt["step"])
    assert_exactly_once(trained(tmp_path / "run1", tmp_path / "run2"))


def test_torchrun_killed_and_resumed_on_the_same_ranks_from_per_rank_states(service, tmp_path):
    """The harness itself, with what works without the elastic state: every rank's state in the
    checkpoint, the same world size."""
    _torchrun_kill_and_resume(service, tmp_path, 2, 2, "per-rank")


def test_torchrun_killed_and_resumed_on_three_ranks_from_rank0s_state(service, tmp_path):
    """2 ranks killed mid-epoch, 3 resume from the checkpoint rank 0 wrote alone."""
    _torchrun_kill_and_resume(service, tmp_path, 2, 3, "rank0")


# ---------------------------------------------------------------------------------------- Lightning


@pytest.mark.parametrize("first, second, epochs", [
    (1, 1, 1),  # what works without the elastic state: rank 0 of 1 saves, rank 0 of 1 resumes
    (2, 1, 1),
    # more ranks: client.lightning.ElasticResume (added by the loader itself: the example does not
    # name it) sets the resumed epoch's count, and gives the next epoch its whole count back
    (2, 3, 2),
])
def test_lightning_killed_and_resumed_from_its_own_checkpoint(service, tmp_path, first, second, epochs):
    """Lightning's ModelCheckpoint saves the loader's state by itself (the fit loop's
    ``combined_loader`` entry) and ``trainer.fit(ckpt_path=...)`` restores it."""
    ckpt_dir = tmp_path / "ckpt"
    val = ["--validate", "--val-batches", "2"]  # a validation loader too, at each epoch's end
    launch(lightning(first, *common(service, tmp_path / "run1"), "--ckpt-dir", str(ckpt_dir), *val,
                     "--hang-after", str(HANG_AFTER)),
           tmp_path / "run1.out", hang_ranks=first, log_dir=tmp_path / "run1")
    ckpt = torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=False)
    loader_states = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(loader_states) == 1 and loader_states[0]["epoch"] == 0, loader_states  # found with no user code
    out = launch(lightning(second, *common(service, tmp_path / "run2", epochs), "--ckpt-dir", str(ckpt_dir),
                           *val, "--resume"), tmp_path / "run2.out")
    assert f"step {CKPT_EVERY}, {second} rank(s)" in out, out
    assert_killed_after_checkpoint(tmp_path / "run1", tmp_path / "run2", ckpt["global_step"])
    assert_exactly_once(trained(tmp_path / "run1", tmp_path / "run2"), epochs)
    # every epoch of the resumed run, the resumed one included, ends with its validation: at its last step
    run2 = attempts(tmp_path / "run2")[0]["ranks"]
    ends = [max(row["step"] for rows in run2.values() for row in rows if row["epoch"] == e) for e in range(epochs)]
    for rank, passes in sorted(val_passes(tmp_path / "run2").items()):
        assert [(p["epoch"], p["step"]) for p in passes if not p["sanity"]] == list(enumerate(ends)), (rank, ends)
    assert sorted(val_passes(tmp_path / "run2")) == [(0, r) for r in range(second)]


# ---------------------------------------------------------------------------------------- validation


def val_passes(log_dir) -> dict:
    """{(attempt, rank): [pass, ...]} from the validation logs, each pass a dict: epoch, step,
    sanity, and its batches' indices in order (one list per batch)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(str(log_dir), "val-attempt*-rank*.jsonl"))):
        a, r = map(int, re.fullmatch(r"val-attempt(\d+)-rank(\d+)\.jsonl", os.path.basename(path)).groups())
        passes = {}
        for row in _rows(path):
            p = passes.setdefault(row["pass"], {"epoch": row["epoch"], "step": row["step"], "sanity": row["sanity"],
                                                "batches": []})
            assert (p["epoch"], p["step"], p["sanity"]) == (row["epoch"], row["step"], row["sanity"]), row
            p["batches"].append(row["indices"])
        out[(a, r)] = [passes[k] for k in sorted(passes)]
    return out


def jobs_of(log_dir) -> tuple:
    """The (training, validation) jobs every rank of every attempt logged: one pair, or fail."""
    pairs = {(row["job"], row["val_job"]) for run in attempts(log_dir) for row in run["start"].values()}
    assert len(pairs) == 1, f"the ranks of a run named different jobs: {pairs}"
    return pairs.pop()


def test_lightning_validates_on_a_remote_loader_with_a_sanity_check_and_limit_val_batches(service, tmp_path):
    """val_dataloader() returns a RemoteLoader beside the training one (default jobs, 2 devices):
    the sanity check (2 batches), then validations after batches 7 and 14 of each of 2 epochs
    (val_check_interval=0.5), each the first 2 batches of the rank's share (limit_val_batches=2). Lightning
    leaves every pass at its limit and iterates the loader again for the next one."""
    launch(lightning(2, *common(service, tmp_path / "log", epochs=2), "--ckpt-dir", str(tmp_path / "ckpt"),
                     "--validate", "--val-batches", "2", "--val-check-interval", "0.5"), tmp_path / "out")
    assert_exactly_once(trained(tmp_path / "log"), epochs=2)
    train_job, val_job = jobs_of(tmp_path / "log")
    assert train_job != val_job and train_job.split("/")[0] == val_job.split("/")[0]  # one launcher, two loaders
    per_rank = 240 // BATCH // 2  # 15 batches; val_check_interval 0.5: after batches 7 and 14 of each epoch
    for rank in range(2):
        passes = val_passes(tmp_path / "log")[(0, rank)]
        assert [(p["sanity"], p["epoch"], p["step"]) for p in passes] == [
            (True, 0, 0), (False, 0, 7), (False, 0, 14), (False, 1, per_rank + 7), (False, 1, per_rank + 14)]
        # shuffle=False, 2 ranks: rank r's first two batches are samples r, r + 2, ..., r + 30; every pass
        first_two = [list(range(rank, 16, 2)), list(range(16 + rank, 32, 2))]
        assert all(p["batches"] == first_two for p in passes), passes


def test_lightning_resumed_on_fewer_devices_validates_at_the_epochs_end(service, tmp_path):
    """2 devices killed mid-epoch, 1 resumes (the example adds no callback): every sample once,
    and the resumed epoch ends where Lightning runs its epoch-end validation: on the loader's
    last batch of the epoch (6 steps of 2 ranks before the checkpoint, then 18 of 1). With
    val_check_interval=0.5 the killed run validated after its sanity check and at step 7 (of
    15), the resumed one at the middle and the end of its 24-batch count: steps 12 and 24."""
    ckpt_dir = tmp_path / "ckpt"
    val = ["--validate", "--val-batches", "2", "--val-check-interval", "0.5"]
    launch(lightning(2, *common(service, tmp_path / "run1"), "--ckpt-dir", str(ckpt_dir), *val,
                     "--hang-after", str(HANG_AFTER)), tmp_path / "run1.out", hang_ranks=2, log_dir=tmp_path / "run1")
    out = launch(lightning(1, *common(service, tmp_path / "run2"), "--ckpt-dir", str(ckpt_dir), *val, "--resume"),
                 tmp_path / "run2.out")
    assert f"step {CKPT_EVERY}, 1 rank(s)" in out, out
    assert_exactly_once(trained(tmp_path / "run1", tmp_path / "run2"))
    last = CKPT_EVERY + (240 - CKPT_EVERY * 2 * BATCH) // BATCH  # 6 + 18
    assert max(row["step"] for row in attempts(tmp_path / "run2")[0]["ranks"][0]) == last
    first = val_passes(tmp_path / "run1")
    assert [[(p["sanity"], p["step"]) for p in first[(0, r)]] for r in (0, 1)] == [[(True, 0), (False, 7)]] * 2
    passes = val_passes(tmp_path / "run2").get((0, 0), [])  # (Lightning runs no sanity check when it resumes)
    assert [(p["sanity"], p["epoch"], p["step"]) for p in passes] == [(False, 0, last // 2), (False, 0, last)]
    assert all(p["batches"] == [list(range(0, 8)), list(range(8, 16))] for p in passes)


def test_torchrun_trains_and_validates_with_two_loaders_in_each_rank_under_the_default_job(service, tmp_path):
    """Two ranks, each with a training and a validation loader, neither given a job: each takes
    torchrun's run id with a digest of its settings, so they are two jobs (no bad_job), and the
    ranks of each loader meet in one. Every sample trained once per epoch, and each epoch-end
    validation sees every sample once across the ranks."""
    launch(torchrun(2, *common(service, tmp_path / "log", epochs=2), "--validate"), tmp_path / "out")
    assert_exactly_once(trained(tmp_path / "log"), epochs=2)
    train_job, val_job = jobs_of(tmp_path / "log")
    assert train_job.startswith("torchelastic:") and train_job != val_job
    assert train_job.split("/")[0] == val_job.split("/")[0]
    passes = val_passes(tmp_path / "log")
    assert sorted(passes) == [(0, 0), (0, 1)]
    for k, epoch in enumerate((0, 1)):
        seen = [i for rank in (0, 1) for b in passes[(0, rank)][k]["batches"] for i in b]
        assert all(passes[(0, rank)][k]["epoch"] == epoch for rank in (0, 1))
        assert sorted(seen) == list(range(240)), f"validation {k}: not every sample once"


# ---------------------------------------------------------------------------------------- accelerate


@pytest.mark.parametrize("first, second", [
    (1, 1),  # what works without the elastic state
    (2, 2),  # rank 1 loads rank 0's state
    (2, 3),
])
def test_accelerate_killed_and_resumed_from_save_state(service, tmp_path, first, second):
    """``register_for_checkpointing(loader)``: save_state() keeps the main process's loader
    state, load_state() gives it to every process."""
    ckpt_dir = tmp_path / "ckpt"
    launch(accelerate(first, *common(service, tmp_path / "run1"), "--ckpt-dir", str(ckpt_dir), "--validate",
                      "--hang-after", str(HANG_AFTER)),
           tmp_path / "run1.out", hang_ranks=first, log_dir=tmp_path / "run1")
    saved = ckpt_dir / (ckpt_dir / "latest").read_text()
    progress = torch.load(saved / "custom_checkpoint_1.pkl", weights_only=False)  # registered second
    assert (saved / "custom_checkpoint_0.pkl").exists()  # the loader's
    out = launch(accelerate(second, *common(service, tmp_path / "run2"), "--ckpt-dir", str(ckpt_dir), "--validate"),
                 tmp_path / "run2.out")
    assert f"step {CKPT_EVERY}, {second} rank(s)" in out, out
    assert_killed_after_checkpoint(tmp_path / "run1", tmp_path / "run2", progress["step"])
    assert_exactly_once(trained(tmp_path / "run1", tmp_path / "run2"))
    # --validate: a validation loader in each process beside the training loader, default jobs; the
    # epoch-end validation of the resumed run sees every sample once across its processes
    train_job, val_job = jobs_of(tmp_path / "run2")
    if second == 1:  # accelerate's plain launcher sets no MASTER_ADDR for one process: no job, no job rules
        assert train_job == val_job == ""
    else:
        assert train_job != val_job and train_job.split("/")[0] == val_job.split("/")[0]
    passes = val_passes(tmp_path / "run2")
    assert sorted(passes) == [(0, r) for r in range(second)] and all(len(p) == 1 for p in passes.values())
    assert sorted(i for p in passes.values() for b in p[0]["batches"] for i in b) == list(range(240))


# ---------------------------------------------------------------------------------------- jobs


def test_two_torchrun_jobs_on_one_service_never_mix(service, tmp_path):
    """Two trainings at once on one service, same dataset and settings but 2 and 3 ranks: each
    is a job of its own (torchrun's run id), so neither is refused (a rank of one job with
    another world size would be: ``bad_job``) or replaced, and each gets every sample once."""
    procs = []
    for name, nproc in (("a", 2), ("b", 3)):
        cmd = torchrun(nproc, *common(service, tmp_path / name))
        out = open(tmp_path / f"{name}.out", "w")
        procs.append((name, subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)))
        out.close()
    try:
        for name, proc in procs:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
            assert rc == 0, f"job {name} exited {rc}:\n{(tmp_path / f'{name}.out').read_text()[-6000:]}"
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                kill_job(proc)
    jobs = {}
    for name in ("a", "b"):
        (run,) = attempts(tmp_path / name)
        jobs[name] = {row["job"] for row in run["start"].values()}
        assert len(jobs[name]) == 1 and next(iter(jobs[name])).startswith("torchelastic:"), jobs[name]
        assert_exactly_once(trained(tmp_path / name))
    assert jobs["a"] != jobs["b"]


@pytest.mark.parametrize("loader_state", [
    "per-rank",  # what works without the elastic state
    ("rank0"),
])
def test_an_elastic_restart_resumes_the_same_job(service, tmp_path, loader_state):
    """torchrun --max-restarts 1: rank 1 dies after step 8 (checkpoint at 6); torchrun restarts
    both ranks with the same TORCHELASTIC_RUN_ID and TORCHELASTIC_RESTART_COUNT=1; they are
    the same job to the service (the new loaders take the old ranks' places) and go on from
    the checkpoint: every sample once."""
    cmd = torchrun(2, *common(service, tmp_path / "log"), "--checkpoint", str(tmp_path / "ckpt.pt"),
                   "--loader-state", loader_state, "--crash-after", str(HANG_AFTER), extra=["--max-restarts", "1"])
    # torchrun's restarts reuse the rendezvous store, where the restarted ranks can read the
    # previous attempt's gloo addresses ("Gloo connectFullMesh failed ... Connection refused", about
    # every other run here): pytorch/pytorch#135712; its workaround, a store of the workers' own
    out = launch(cmd, tmp_path / "out", env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert "crashing after step 8" in out
    first, second = attempts(tmp_path / "log")
    assert {r["job"] for r in first["start"].values()} == {r["job"] for r in second["start"].values()}
    assert resumed_from(first) is None and resumed_from(second) == CKPT_EVERY
    assert_exactly_once(trained(tmp_path / "log"))
