"""The knobs-file watcher: the contract's parsing, ConfigMap-style symlink swaps, last good knobs kept."""

from __future__ import annotations

import json
import os

import pytest

from chunkpilot.engine.core.knobs import KnobHolder, SchedulerKnobs
from chunkpilot.engine.core.knobs_file import KnobsFileWatcher, parse_knobs, write_knobs


def test_parse_accepts_exactly_the_contract():
    assert parse_knobs('{"token_budget": 64, "max_chunk": 32, "generation": 7}') == SchedulerKnobs(64, 32, 7)
    for bad, why in [
        ("{", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"token_budget": 64, "max_chunk": 32}', "lacks generation"),
        ('{"token_budget": 64, "max_chunk": 32, "generation": 1, "max_chunks": 3}', "unknown keys max_chunks"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_knobs(bad)


def configmap_update(root, knobs: dict, version: int) -> None:
    """What the kubelet does: write a fresh timestamped folder, then atomically swap the `..data` symlink."""
    d = root / f"..2026_11_29_{version}"
    d.mkdir()
    (d / "knobs.json").write_text(json.dumps(knobs))
    tmp = root / "..data_tmp"
    os.symlink(d.name, tmp)
    os.replace(tmp, root / "..data")
    if not (root / "knobs.json").is_symlink():
        os.symlink("..data/knobs.json", root / "knobs.json")


def test_configmap_symlink_swaps_are_seen_and_bad_content_is_refused(tmp_path):
    holder = KnobHolder(SchedulerKnobs(64, 64, 0), min_token_budget=8)
    errors, applied = [], []
    watcher = KnobsFileWatcher(tmp_path / "knobs.json", holder, on_error=errors.append, on_apply=applied.append)
    assert not watcher.check()  # no file yet: nothing happens
    configmap_update(tmp_path, {"token_budget": 128, "max_chunk": 32, "generation": 1}, 1)
    assert watcher.check() and holder.get() == SchedulerKnobs(128, 32, 1)
    assert not watcher.check()  # unchanged content is not applied twice
    configmap_update(tmp_path, {"token_budget": 256, "max_chunk": 64, "generation": 2}, 2)
    assert watcher.check() and holder.get() == SchedulerKnobs(256, 64, 2)
    configmap_update(tmp_path, {"token_budget": 4, "max_chunk": 4, "generation": 3}, 3)  # below max_num_seqs
    assert not watcher.check() and holder.get() == SchedulerKnobs(256, 64, 2)
    assert len(errors) == 1 and "token_budget must be >= max_num_seqs = 8" in errors[0] and "keeping" in errors[0]
    assert not watcher.check() and len(errors) == 1  # the same bad file is reported once, not every poll
    configmap_update(tmp_path, {"token_budget": 32, "max_chunk": 16, "generation": 4}, 4)
    assert watcher.check() and holder.get() == SchedulerKnobs(32, 16, 4)
    assert [k.generation for k in applied] == [1, 2, 4]


def test_background_thread_applies_changes(tmp_path):
    import time

    path = tmp_path / "knobs.json"
    write_knobs(path, SchedulerKnobs(64, 16, 1))
    holder = KnobHolder(SchedulerKnobs(64, 64, 0))
    watcher = KnobsFileWatcher(path, holder, poll_interval=0.02)
    watcher.start()
    try:
        assert holder.get() == SchedulerKnobs(64, 16, 1)  # applied at start, before serving
        write_knobs(path, SchedulerKnobs(96, 48, 2))
        deadline = time.monotonic() + 2
        while holder.get().generation != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert holder.get() == SchedulerKnobs(96, 48, 2)
    finally:
        watcher.stop()
