"""The loader's state: checked whole at load_state_dict, before any connection (no service runs
here: a refused state never reaches the network), and version 1 read as a position."""

import logging

import pytest

from client import RemoteLoader

ENDPOINT = "tcp://127.0.0.1:9"  # nothing listens: load_state_dict must not need it


@pytest.fixture
def loader():
    with RemoteLoader(ENDPOINT, batch_size=16, world_size=2, seed=3, timeout=1) as ld:
        yield ld


def good(**changes):
    state = {"version": 2, "epoch": 1, "position": 96, "seed": 3, "shuffle": True, "drop_last": False,
             "dataset": None, "dataset_length": 240, "fingerprint": "ab" * 12, "world_size": 2, "batch_size": 16}
    state.update(changes)
    return state


def test_a_fresh_loader_describes_its_position_without_a_connection(loader):
    assert loader.state_dict() == {"version": 2, "epoch": 0, "position": 0, "seed": 3, "shuffle": True,
                                   "drop_last": False, "dataset": None, "dataset_length": None,
                                   "fingerprint": None, "world_size": 2, "batch_size": 16}


def test_a_good_state_loads_and_is_given_back_unchanged_until_an_iteration(loader):
    loader.load_state_dict(good())
    assert loader.state_dict()["position"] == 96 and loader.state_dict()["epoch"] == 1


@pytest.mark.parametrize("state, match", [
    ([1, 2], "a loader state is a dict .*got list"),
    ("state", "a loader state is a dict .*got str"),
    (good(version=3), "unsupported loader state version 3"),
    ({k: v for k, v in good().items() if k != "position"}, "missing 'position'"),
    ({k: v for k, v in good().items() if k != "fingerprint"}, "missing 'fingerprint'"),
    (good(position=2.9), "position must be int, got float 2.9"),
    (good(position=True), "position must be int, got bool True"),
    (good(epoch=-1), "epoch must be >= 0, got -1"),
    (good(position=-3), "position must be >= 0, got -3"),
    (good(position=10**9), "position 1000000000 is past the end of the epoch .240 samples."),
    (good(dataset_length=0), "dataset_length must be >= 1"),
    (good(shuffle="yes"), "shuffle must be bool"),
    (good(dataset=5), "dataset must be a str or None"),
    (good(world_size=0), "world_size must be >= 1"),
    (good(seed=4), r"does not match this loader's plan \(seed: saved 4 vs loader 3\)"),
    (good(drop_last=True), r"drop_last: saved True vs loader False"),
    (good(dataset="other"), r"dataset: saved 'other' vs loader None"),
])
def test_a_bad_state_is_a_value_error_naming_the_field(loader, state, match):
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)
    assert loader.state_dict()["position"] == 0  # nothing of it was taken


def test_another_world_size_and_batch_size_are_accepted(loader):
    loader.load_state_dict(good(world_size=3, batch_size=5, position=45))
    assert loader.state_dict()["position"] == 45


def test_a_version_1_state_is_read_as_the_jobs_position(loader, caplog):
    caplog.set_level(logging.INFO, logger="client")
    loader.load_state_dict({"version": 1, "epoch": 2, "next_batch": 3, "seed": 3, "world_size": 2, "rank": 1,
                            "batch_size": 16, "shuffle": True, "drop_last": False, "dataset": None})
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (2, 3 * 16 * 2)
    assert "version-1 loader state" in caplog.text


@pytest.mark.parametrize("state, match", [
    ({"version": 1, "epoch": 0}, r"version 1.*missing 'next_batch'"),
    ({"version": 1, "epoch": 0, "next_batch": -3, "seed": 3, "world_size": 2, "batch_size": 16, "shuffle": True,
      "drop_last": False, "dataset": None}, "next_batch must be a positive int"),
])
def test_a_bad_version_1_state_is_refused_naming_the_field(loader, state, match):
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)


def test_a_shuffle_window_is_part_of_the_order_a_state_names_and_absent_means_none():
    """shuffle_window (added after version 2) is written only when set, so a W = 0 state is the
    same as before; a state without it (older, or W = 0) resumes only a loader without a window."""
    with RemoteLoader(ENDPOINT, batch_size=16, world_size=2, seed=3, shuffle_window=8, timeout=1) as windowed:
        assert windowed.state_dict()["shuffle_window"] == 8
        windowed.load_state_dict(good(shuffle_window=8))
        with pytest.raises(ValueError, match=r"shuffle_window: saved 0 vs loader 8"):
            windowed.load_state_dict(good())  # a state saved before the window, or without one
        with pytest.raises(ValueError, match=r"shuffle_window must be int"):
            windowed.load_state_dict(good(shuffle_window="8"))
    with RemoteLoader(ENDPOINT, batch_size=16, world_size=2, seed=3, timeout=1) as plain:
        assert "shuffle_window" not in plain.state_dict()
        with pytest.raises(ValueError, match=r"shuffle_window: saved 4 vs loader 0"):
            plain.load_state_dict(good(shuffle_window=4))
