"""Configuration files: parse, re-read on change, report bad input, keep last good."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from agent.core.store.base import ConfigurationEvent, EventType
from agent.core.store.config_files import ConfigurationFiles

GOOD = """apiVersion: akri.sh/v0
kind: Configuration
metadata: {{name: {name}}}
spec:
  discoveryHandler: {{name: debugEcho, discoveryDetails: "descriptions: [a]"}}
  capacity: {capacity}
"""


def write(path: Path, text: str) -> None:
    path.write_text(text)
    # make sure the change is visible even within one mtime tick
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))


def settle(files: ConfigurationFiles) -> None:
    """Two polls: a change is applied once it has been stable for one poll."""
    files.scan()
    files.scan()


@pytest.fixture
def events() -> list[ConfigurationEvent]:
    return []


def test_add_modify_delete(tmp_path: Path, events: list[ConfigurationEvent]) -> None:
    path = tmp_path / "c.yaml"
    write(path, GOOD.format(name="one", capacity=1) + "---\n" + GOOD.format(name="two", capacity=1))
    files = ConfigurationFiles([path], events.append)
    settle(files)
    assert [(e.type, e.name) for e in events] == [
        (EventType.ADDED, "one"),
        (EventType.ADDED, "two"),
    ]
    events.clear()
    settle(files)
    assert events == []  # unchanged file: nothing re-emitted
    write(path, GOOD.format(name="one", capacity=3))
    settle(files)
    assert [(e.type, e.name) for e in events] == [
        (EventType.DELETED, "two"),
        (EventType.MODIFIED, "one"),
    ]
    assert events[1].configuration is not None and events[1].configuration.capacity == 3
    events.clear()
    path.unlink()
    settle(files)
    assert (EventType.DELETED, "one") in [(e.type, e.name) for e in events]


def test_directory_of_files(tmp_path: Path, events: list[ConfigurationEvent]) -> None:
    write(tmp_path / "a.yaml", GOOD.format(name="a", capacity=1))
    write(tmp_path / "b.yml", GOOD.format(name="b", capacity=1))
    write(tmp_path / "notes.txt", "ignored")
    files = ConfigurationFiles([tmp_path], events.append)
    settle(files)
    assert [c.name for c in files.current()] == ["a", "b"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (": : :", "not valid YAML"),
        (GOOD.format(name="x", capacity=-1), "spec.capacity"),
        (GOOD.format(name="x", capacity=100000), "spec.capacity"),
        (GOOD.format(name="x", capacity=1).replace("Configuration", "Pod"), "kind"),
        ("- just\n- a list\n", "<root>"),
    ],
)
def test_bad_files_are_reported_with_file_and_field(
    tmp_path: Path,
    events: list[ConfigurationEvent],
    caplog: pytest.LogCaptureFixture,
    text: str,
    needle: str,
) -> None:
    good = tmp_path / "good.yaml"
    bad = tmp_path / "bad.yaml"
    write(good, GOOD.format(name="good", capacity=1))
    write(bad, text)
    files = ConfigurationFiles([good, bad], events.append)
    with caplog.at_level(logging.ERROR):
        settle(files)
    assert [c.name for c in files.current()] == ["good"]
    errors = [e for e in events if e.error]
    assert len(errors) == 1
    assert str(bad) in (errors[0].error or "") and needle in (errors[0].error or "")
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and str(bad) in lines[0] and needle in lines[0]
    caplog.clear()
    settle(files)  # unchanged: the same problem is not logged again every poll
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_last_good_version_survives_a_broken_edit(
    tmp_path: Path, events: list[ConfigurationEvent]
) -> None:
    path = tmp_path / "c.yaml"
    write(path, GOOD.format(name="one", capacity=2))
    files = ConfigurationFiles([path], events.append)
    settle(files)
    write(path, "{{{ not yaml")
    settle(files)
    assert [c.capacity for c in files.current()] == [2]
    write(path, GOOD.format(name="one", capacity=-4))
    settle(files)
    assert [c.capacity for c in files.current()] == [2]
    write(path, GOOD.format(name="one", capacity=4))
    settle(files)
    assert [c.capacity for c in files.current()] == [4]


def test_a_misspelt_field_is_an_error_and_the_last_good_version_keeps_running(
    tmp_path: Path, events: list[ConfigurationEvent]
) -> None:
    """Issue 34.8: ``capacty: 3`` was ignored in silence (capacity 1 applied); a real API
    server refuses unknown fields, so local files do too, naming the field and its fix."""
    path = tmp_path / "c.yaml"
    write(path, GOOD.format(name="one", capacity=2))
    files = ConfigurationFiles([path], events.append)
    settle(files)
    write(path, GOOD.format(name="one", capacity=2).replace("capacity: 2", "capacty: 3"))
    settle(files)
    assert [c.capacity for c in files.current()] == [2]  # the previous good version
    (error,) = [e.error for e in events if e.error]
    assert error == f"{path}: spec.capacty: unknown field (did you mean 'capacity'?)"
    write(path, GOOD.format(name="two", capacity=1) + "  brokerProperites: {A: b}\n")
    settle(files)
    assert files.current() == []  # "one" left the file; "two" was never valid: not applied
    assert any("spec.brokerProperites: unknown field (did you mean 'brokerProperties'?)" in
               (e.error or "") for e in events)  # fmt: skip


def test_duplicate_names_first_wins(tmp_path: Path, events: list[ConfigurationEvent]) -> None:
    first, second = tmp_path / "1.yaml", tmp_path / "2.yaml"
    write(first, GOOD.format(name="same", capacity=1))
    write(second, GOOD.format(name="same", capacity=5))
    files = ConfigurationFiles([first, second], events.append)
    settle(files)
    assert [c.capacity for c in files.current()] == [1]
    assert any(
        "duplicate Configuration default/same" in (e.error or "")
        and (e.error or "").startswith(str(second))
        for e in events
    )


def test_a_new_file_never_takes_over_a_running_configuration(
    tmp_path: Path, events: list[ConfigurationEvent]
) -> None:
    """Issue 11 case 5: a new file that sorts first and defines the name of a running
    Configuration is refused (naming the new file); the old one keeps running unchanged."""
    old = tmp_path / "b-old.yaml"
    write(old, GOOD.format(name="same", capacity=1))
    files = ConfigurationFiles([tmp_path], events.append)
    settle(files)
    assert [(c.name, c.capacity) for c in files.current()] == [("same", 1)]
    events.clear()
    new = tmp_path / "a-new.yaml"  # sorts before the running one
    write(new, GOOD.format(name="same", capacity=7))
    settle(files)
    assert [(c.name, c.capacity) for c in files.current()] == [("same", 1)]
    assert [e for e in events if e.error is None] == []  # no DELETED/ADDED/MODIFIED
    errors = [e.error or "" for e in events]
    assert len(errors) == 1 and errors[0].startswith(str(new)), errors
    assert f"already defined in {old}" in errors[0]
    # the old file goes away: the new definition takes over
    events.clear()
    old.unlink()
    settle(files)
    assert [(c.name, c.capacity) for c in files.current()] == [("same", 7)]
    assert [(e.type, e.name) for e in events if e.error is None] == [(EventType.MODIFIED, "same")]


def test_invalid_and_unreadable_sources_are_known(
    tmp_path: Path, events: list[ConfigurationEvent]
) -> None:
    """A never-valid Configuration is still known by key; a file that is not YAML makes the
    set of Configurations unknown (no Instance may be taken for an orphan meanwhile)."""
    bad = tmp_path / "bad.yaml"
    write(bad, GOOD.format(name="broken", capacity=0))
    files = ConfigurationFiles([tmp_path], events.append)
    settle(files)
    assert files.current() == []
    assert [i.key.name for i in files.invalid()] == ["broken"]
    assert "spec.capacity" in files.invalid()[0].message
    assert files.unreadable() == []
    write(bad, "kind: [unclosed")
    settle(files)
    assert [i.key.name for i in files.invalid()] == ["broken"]  # kept while unreadable
    assert len(files.unreadable()) == 1 and str(bad) in files.unreadable()[0]
    write(bad, GOOD.format(name="broken", capacity=2))
    settle(files)
    assert files.invalid() == [] and files.unreadable() == []
    assert [c.name for c in files.current()] == ["broken"]
    assert files.current()[0].creation_timestamp is not None


def test_missing_file_is_reported(tmp_path: Path, events: list[ConfigurationEvent]) -> None:
    files = ConfigurationFiles([tmp_path / "nope.yaml"], events.append)
    settle(files)
    assert files.current() == []
    assert "file not found" in (events[0].error or "")


def test_half_written_file_is_not_acted_on(
    tmp_path: Path, events: list[ConfigurationEvent]
) -> None:
    path = tmp_path / "c.yaml"
    write(path, GOOD.format(name="one", capacity=2))
    files = ConfigurationFiles([path], events.append)
    files.scan()  # files present at start are read at once
    assert [e.name for e in events] == ["one"]
    events.clear()
    write(path, "")  # truncated by an editor...
    files.scan()
    write(path, GOOD.format(name="one", capacity=3))  # ...and written again before the next poll
    files.scan()
    assert events == []  # never saw a stable empty file: nothing deleted
    files.scan()
    assert [(e.type, e.name) for e in events] == [(EventType.MODIFIED, "one")]


def test_a_fixed_configuration_says_it_is_accepted_again(
    tmp_path: Path, events: list[ConfigurationEvent], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c.yaml"
    write(path, GOOD.format(name="one", capacity=1))
    files = ConfigurationFiles([path], events.append)
    settle(files)
    write(path, GOOD.format(name="one", capacity=-3))
    settle(files)
    with caplog.at_level(logging.INFO):
        write(path, GOOD.format(name="one", capacity=4))
        settle(files)
    assert any(
        "default/one" in r.getMessage() and "valid again" in r.getMessage() for r in caplog.records
    )
    assert [c.capacity for c in files.current()] == [4]


def test_concerns_answers_the_local_stores_own_file_names_without_a_stat(
    tmp_path: Path, events: list[ConfigurationEvent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local store asks, for every entry its own writes touch (a journal line, the
    counter's temp file and rename), whether Configuration files are concerned: two stats per
    configured path each time, on the hot path of an Allocate (issue 27). The answer for a
    name that is neither a configured file's nor YAML needs none."""
    folder = tmp_path / "configs"
    folder.mkdir()
    single = tmp_path / "one.conf"
    write(single, "")
    files = ConfigurationFiles([folder, single], events.append)
    stats: list[Path] = []
    real_is_dir = Path.is_dir

    def counted(path: Path) -> bool:
        stats.append(path)
        return real_is_dir(path)

    monkeypatch.setattr(Path, "is_dir", counted)
    for name in ("big-abcdef.json.journal", ".resourceVersion.tmp-1", "resourceVersion"):
        assert not files.concerns(name)
    assert stats == []
    # what can matter still does (each answer stats the configured paths)
    assert files.concerns("one.conf") and files.concerns("new.yaml")
    assert not ConfigurationFiles([single], events.append).concerns("new.yaml")
    assert stats
