"""A service without a configured API token keeps its generated token in one file per service
(named after its REST port), reuses it when started again on that port (also after a SIGKILL),
and removes it when it stops (issue 38: 93 files in /tmp after one afternoon)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile

import pytest

from loader_service.control import auth
from loader_service.control.auth import resolve_token
from testkit.paths import REPO_ROOT
from testkit.service import ServiceProcess, free_port


@pytest.fixture
def tmpdir_only(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_generated_token_is_kept_per_port_and_reused(tmpdir_only, caplog):
    with caplog.at_level("WARNING", logger="loader_service.control.auth"):
        first = resolve_token("", "", 8123, "0.0.0.0")
    path = str(tmpdir_only / "loader-api-token-8123")
    assert first.source == "generated" and first.generated_file == path
    assert open(path).read() == first.value + "\n" and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert f"loader-service scale N (as this user on this machine; elsewhere with LOADER_API_TOKEN_FILE={path})" \
        in caplog.text and first.value not in caplog.text
    again = resolve_token("", "", 8123, "0.0.0.0")
    assert again == first  # the next service on the port takes the same token over
    assert resolve_token("", "", 8123, "127.0.0.1") == first  # loopback and every address: one service per port
    other = resolve_token("", "", 8123, "10.1.2.3")  # another address: another service, another file
    assert other.generated_file == str(tmpdir_only / "loader-api-token-10_1_2_3-8123") and other.value != first.value
    assert sorted(os.listdir(tmpdir_only)) == ["loader-api-token-10_1_2_3-8123", "loader-api-token-8123"]


def test_a_file_that_is_not_ours_is_never_reused_nor_followed(tmpdir_only, caplog):
    path = tmpdir_only / "loader-api-token-8124"
    path.write_text("readable-by-all\n")
    os.chmod(path, 0o644)
    with caplog.at_level("WARNING", logger="loader_service.control.auth"):
        tok = resolve_token("", "", 8124)
    assert tok.value != "readable-by-all" and tok.generated_file != str(path)
    assert "is not this user's 0600 token file: left alone" in caplog.text
    assert path.read_text() == "readable-by-all\n"  # left as it was
    os.unlink(tok.generated_file)

    target = tmpdir_only / "target"
    target.write_text("secret\n")
    os.chmod(target, 0o600)
    link = tmpdir_only / "loader-api-token-8125"
    link.symlink_to(target)
    tok = resolve_token("", "", 8125)
    assert tok.value != "secret" and tok.generated_file != str(link) and target.read_text() == "secret\n"
    os.unlink(tok.generated_file)


def test_port_chosen_at_start_gets_a_fresh_file(tmpdir_only):
    tok = resolve_token("", "", 0)
    assert os.path.dirname(tok.generated_file) == str(tmpdir_only)
    assert os.path.basename(tok.generated_file).startswith("loader-api-token-")
    os.unlink(tok.generated_file)


def test_container_hint_names_a_command_for_the_host(monkeypatch):
    monkeypatch.setattr(auth, "in_container", lambda: "3f2a9c1b7d0e")
    hint = auth.scale_hint("/tmp/loader-api-token-8080")
    assert "from the host of this container: docker exec 3f2a9c1b7d0e loader-service scale N" in hint
    assert "(with Compose: docker compose exec loader loader-service scale N)" in hint
    monkeypatch.setattr(auth, "in_container", lambda: "")
    assert auth.scale_hint("/x") == \
        "loader-service scale N (as this user on this machine; elsewhere with LOADER_API_TOKEN_FILE=/x)"


def test_a_killed_service_leaves_one_file_that_its_successor_reuses_and_removes(tmp_path):
    http_port = free_port()
    args = ["--demo", "--demo-size", "16", "--workers", "1"]
    env = {"LOADER_API_TOKEN": None, "TMPDIR": str(tmp_path)}
    name = f"loader-api-token-{http_port}"
    svc = ServiceProcess(free_port(), args, env=env, http_port=http_port)
    try:
        token = (tmp_path / name).read_text().strip()
        svc.token = token
        assert svc.scale(2)["target"] == 2  # the file holds the token the service checks
        assert svc.kill(signal.SIGKILL) == -signal.SIGKILL
    finally:
        svc.stop()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("loader-api-token-")] == [name]
    again = ServiceProcess(free_port(), args, env=env, http_port=http_port, token=token)
    try:
        assert (tmp_path / name).read_text().strip() == token
        assert again.scale(1)["target"] == 1  # an operator's LOADER_API_TOKEN_FILE still works
        # and `loader-service scale` on this machine finds the generated token by the URL's port by itself
        env_cli = {k: v for k, v in os.environ.items() if not k.startswith("LOADER_API_TOKEN")}
        cli = subprocess.run([sys.executable, "-m", "loader_service.cli.main", "scale", "3", "--url",
                              f"http://127.0.0.1:{http_port}"], capture_output=True, text=True, timeout=120,
                             env=dict(env_cli, TMPDIR=str(tmp_path), PYTHONPATH=REPO_ROOT), cwd=REPO_ROOT)
        assert cli.returncode == 0 and cli.stdout.strip() == "workers: 1 -> 3", cli.stdout + cli.stderr
        elsewhere = subprocess.run([sys.executable, "-m", "loader_service.cli.main", "scale", "3", "--url",
                                    f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=120,
                                   env=dict(env_cli, TMPDIR=str(tmp_path), PYTHONPATH=REPO_ROOT), cwd=REPO_ROOT)
        assert "needs the API token" in elsewhere.stderr  # another port: no file of its own, nothing guessed
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("loader-api-token-")] == [name]
    finally:
        again.stop()
    assert again.proc.returncode in (0, -signal.SIGTERM)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("loader-api-token-")]
