"""The configuration model: one list of options, read from defaults < config file < LOADER_* <
flags; bad values named with their source; ``loader-service config`` prints the effective
configuration with the token redacted."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib

import pytest

from loader_service.cli.main import main
from loader_service.config import REDACTED, ServiceConfig, load_config, option_extra, option_fields
from loader_service.cli.settings import add_config_options, config_from_args, flag_name


def test_every_option_has_help_and_a_flag_or_a_reason():
    for name, info in option_fields().items():
        assert info.description, f"{name}: no description (it is the --help text)"
    flags = [flag_name(n) for n in option_fields() if option_extra(n)["cli"]]
    assert len(flags) == len(set(flags))
    # flags older releases documented keep their names
    assert {"--data", "--demo", "--workers", "--task-deadline", "--task-deadline-floor", "--autoscale-interval",
            "--status-log", "--max-skipped", "--on-error", "--http-port"} <= set(flags)
    assert not option_extra("api_token")["cli"], "a token on a command line is visible in ps"


def test_construction_and_fields_unchanged():
    c = ServiceConfig(demo=True, workers=2, data_port=0)
    assert (c.workers, c.data_port, c.http_port, c.on_error) == (2, 0, 8080, "raise")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.workers = 3  # type: ignore[misc]
    assert "api_token" in {f.name for f in dataclasses.fields(ServiceConfig)}
    assert "sekrit" not in repr(ServiceConfig(demo=True, api_token="sekrit"))


def test_precedence_file_env_flags(tmp_path):
    f = tmp_path / "loader.toml"
    f.write_text('demo = true\nworkers = 2\nmax_skipped = 7\non_error = "skip"\ndata = ["/a", "/b"]\n')
    env = {"LOADER_WORKERS": "3", "LOADER_MAX_SKIPPED": "", "LOADER_CONFIG": str(f)}
    loaded = load_config(environ=env, overrides={"on_error": "raise"}, override_origin={"on_error": "flag --on-error"})
    c = loaded.config
    assert (c.workers, c.max_skipped, c.on_error, c.data, c.demo) == (3, 7, "raise", ("/a", "/b"), True)
    assert loaded.origin["workers"] == "environment LOADER_WORKERS"
    assert loaded.origin["max_skipped"] == f"config file {f}"  # an empty variable does not count
    assert loaded.origin["on_error"] == "flag --on-error"
    assert loaded.origin["http_port"] == "default"


def test_env_data_is_a_path_list():
    c = ServiceConfig.from_env({"LOADER_DATA": "/x:/y", "LOADER_DEMO": "no"})
    assert c.data == ("/x", "/y") and c.demo is False


@pytest.mark.parametrize("env,overrides,expected", [
    ({"LOADER_DEMO": "1", "LOADER_WORKERS": "many"}, {},
     "workers='many' (from environment LOADER_WORKERS): Input should be a valid integer"),
    ({"LOADER_DEMO": "maybe"}, {}, "demo='maybe' (from environment LOADER_DEMO): Input should be a valid boolean"),
    ({"LOADER_DEMO": "1", "LOADER_WORKERS": "300"}, {},
     "workers must be in [0, 256], got 300 (workers from environment LOADER_WORKERS)"),
    ({"LOADER_DEMO": "1"}, {"on_error": "ignore"}, "on_error must be one of ('raise', 'skip'), got 'ignore' "
                                                  "(on_error from argument)"),
    ({}, {}, "no dataset: give --data PATH"),
    ({"LOADER_DEMO": "1", "LOADER_WORKER_NICE": "20"}, {},
     "worker_nice must be in [0, 19], got 20 (worker_nice from environment LOADER_WORKER_NICE)"),
    ({"LOADER_DEMO": "1"}, {"worker_nice": -1}, "worker_nice must be in [0, 19], got -1 (worker_nice from argument)"),
])
def test_errors_name_option_and_source(env, overrides, expected):
    with pytest.raises(ValueError) as err:
        load_config(environ=env, overrides=overrides)
    assert str(err.value).startswith("invalid configuration: ")
    assert expected in str(err.value)


def test_config_file_errors(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("demo = true\nwrokers = 2\n")
    with pytest.raises(ValueError, match=r"config file .*c.toml: unknown option\(s\) wrokers"):
        load_config(environ={}, config_file=str(f))
    f.write_text("demo = true\nworkers = 'two'\n")
    with pytest.raises(ValueError, match=r"workers='two' \(from config file .*c.toml\): Input should be a valid int"):
        load_config(environ={}, config_file=str(f))
    f.write_text("demo = \n")
    with pytest.raises(ValueError, match=r"config file .*c.toml: "):
        load_config(environ={}, config_file=str(f))
    with pytest.raises(ValueError, match="config file .*missing.toml: not found"):
        load_config(environ={}, config_file=str(tmp_path / "missing.toml"))
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"demo": True, "workers": 1}))
    assert load_config(environ={}, config_file=str(j)).config.workers == 1


def test_generated_flags(monkeypatch):
    monkeypatch.delenv("LOADER_WORKERS", raising=False)
    p = argparse.ArgumentParser()
    p.set_defaults(command="serve")
    add_config_options(p)
    args = p.parse_args(["--data", "/a", "--data", "/b", "--no-demo", "--workers", "2", "--task-deadline", "4.5"])
    loaded = config_from_args(args)
    c = loaded.config
    assert (c.data, c.demo, c.workers, c.task_deadline_s) == (("/a", "/b"), False, 2, 4.5)
    assert loaded.origin["task_deadline_s"] == "flag --task-deadline"
    with pytest.raises(SystemExit):  # choices are argparse's own
        p.parse_args(["--on-error", "ignore"])


def test_cli_config_prints_toml_with_token_redacted(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LOADER_API_TOKEN", "sekrit-token")
    monkeypatch.setenv("LOADER_WORKERS", "2")
    assert main(["config", "--demo", "--max-skipped", "5"]) == 0
    out = capsys.readouterr().out
    assert "sekrit-token" not in out
    parsed = tomllib.loads(out)
    assert parsed["api_token"] == REDACTED and parsed["workers"] == 2 and parsed["max_skipped"] == 5
    assert "# environment LOADER_WORKERS" in out and "# flag --max-skipped" in out
    # the output is a config file the service reads back (less the redacted token)
    f = tmp_path / "saved.toml"
    f.write_text("\n".join(line for line in out.splitlines() if not line.startswith("api_token")))
    monkeypatch.delenv("LOADER_API_TOKEN")
    again = load_config(environ={}, config_file=str(f)).config
    assert (again.workers, again.max_skipped, again.demo) == (2, 5, True)


def test_cli_bad_value_exits_2_with_the_source(monkeypatch, capsys):
    monkeypatch.setenv("LOADER_HTTP_PORT", "99999")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--demo"])
    assert exc.value.code == 2
    assert "http_port must be in [0, 65535], got 99999 (http_port from environment LOADER_HTTP_PORT)" in \
        capsys.readouterr().err
