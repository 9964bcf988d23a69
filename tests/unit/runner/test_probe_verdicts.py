"""runner/probe_verdicts.py without MLX: a verdict is probed once and read back from its file
after that; outside `using` every call probes; an unreadable file is probed afresh and an
unwritable directory only logged; a save prunes the least recently used files."""

from __future__ import annotations

import json
import os
import logging

from mlxr.runner import probe_verdicts
from mlxr.runner.probe_verdicts import Verdicts, decide, using


class Probe:
    def __init__(self, verdict: bool):
        self.verdict, self.calls = verdict, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.verdict


def test_a_verdict_is_probed_once_then_read_from_its_file(tmp_path):
    rows, body = Probe(True), Probe(False)
    with using(Verdicts.open(tmp_path, "model A")) as verdicts:
        assert decide("rows", rows) is True and decide("host_body", body) is False
        assert decide("rows", rows) is True
        verdicts.save()
    assert (rows.calls, body.calls, verdicts.read) == (1, 1, 0)
    [path] = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["verdicts"] == {"rows": True, "host_body": False}
    with using(Verdicts.open(tmp_path, "model A")) as again:
        assert decide("rows", rows) is True and decide("host_body", body) is False
    assert (rows.calls, body.calls, again.read) == (1, 1, 2)
    with using(Verdicts.open(tmp_path, "model B")):  # another key: its own file
        assert decide("rows", Probe(False)) is False


def test_outside_using_every_call_probes():
    probe = Probe(True)
    assert decide("rows", probe) and decide("rows", probe)
    assert probe.calls == 2
    with using(None):
        assert decide("rows", probe)
    assert probe.calls == 3


def test_nothing_is_written_when_every_verdict_was_read(tmp_path):
    with using(Verdicts.open(tmp_path, "k")) as verdicts:
        decide("split", Probe(True))
        verdicts.save()
    [path] = tmp_path.glob("*.json")
    path.write_text(json.dumps({"version": probe_verdicts.VERSION,
                                "verdicts": {"split": False}}))
    before = path.stat().st_ino
    with using(Verdicts.open(tmp_path, "k")) as verdicts:
        assert decide("split", Probe(True)) is False
        verdicts.save()
    assert path.stat().st_ino == before  # a save replaces the file: a new inode
    assert json.loads(path.read_text())["verdicts"] == {"split": False}


def test_a_damaged_or_foreign_file_is_probed_afresh(tmp_path):
    for text in ("{not json", json.dumps([1, 2]), json.dumps({"version": 999,
                 "verdicts": {"rows": False}}), json.dumps({"version": probe_verdicts.VERSION,
                 "verdicts": {"rows": "yes"}})):
        verdicts = Verdicts.open(tmp_path, "k")
        verdicts.path.write_text(text)
        verdicts = Verdicts.open(tmp_path, "k")
        probe = Probe(True)
        with using(verdicts):
            assert decide("rows", probe) is True
        assert probe.calls == 1 and verdicts.read == 0
        verdicts.save()
        assert json.loads(verdicts.path.read_text())["verdicts"] == {"rows": True}


def test_an_unwritable_directory_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    verdicts = Verdicts.open(blocker / "probes", "k")  # its parent is a file
    with using(verdicts), caplog.at_level(logging.INFO, "mlxr.runner"):
        assert decide("rows", Probe(True))
        verdicts.save()
    assert "could not keep the probes' verdicts" in caplog.text


def test_a_save_keeps_the_most_recently_used_files(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_verdicts, "KEEP", 3)

    def save(key: str) -> None:
        with using(Verdicts.open(tmp_path, key)) as verdicts:
            decide("rows", Probe(True))
            verdicts.save()

    for age, key in enumerate(["a", "b", "c"]):
        save(key)
        path = Verdicts.open(tmp_path, key).path
        os.utime(path, ns=(age * 10**9, age * 10**9))  # a oldest
    Verdicts.open(tmp_path, "a")  # read: now the most recently used
    save("d")
    kept = {path.name for path in tmp_path.glob("*.json")}
    assert kept == {Verdicts.open(tmp_path, key).path.name for key in ("a", "c", "d")}
