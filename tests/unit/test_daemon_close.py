"""What the daemon and `watchdog dump` build for the other nodes' evidence (ssh masters, temp dirs) is closed when
they end, however they end."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, ClassVar

import pytest

from watchdog.cli import evidence as evidence_cli
from watchdog.config.load import Config, load
from watchdog.service import daemon as daemon_module

NODE = '[[nodes]]\nname = "worker1"\nhost = "10.0.0.2"\nidentity_file = "/k"\nknown_hosts_file = "/kh"\n'


class FakeRemote:
    built: ClassVar[list[FakeRemote]] = []

    def __init__(self, cfg: Config) -> None:
        self.closed = 0
        FakeRemote.built.append(self)

    def close(self) -> None:
        self.closed += 1


class FakeInvestigator:
    def __init__(self, cfg: Config, http: object, gpu: object = None, others: object = None,
                 reading: object = None) -> None:
        self.others = others
        self.incidents_dir = Path("/nonexistent")

    def preflight(self) -> list[str]:
        return []

    def investigate(self, **_: Any) -> None:
        raise RuntimeError("the capture broke")


class Closable:
    def __init__(self, *_: object, **__: object) -> None:
        pass

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass

    def views(self) -> list[object]:
        return []

    def delivering(self) -> list[tuple[str, str, bool]]:
        return []


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    FakeRemote.built.clear()
    p = tmp_path / "w.toml"
    p.write_text('[engine]\nurl = "http://127.0.0.1:9"\n[gpu]\nenabled = false\n[exporter]\nport = 0\n' + NODE)
    return load(p)


def test_the_daemon_closes_the_remote_evidence(cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, fake in (("RemoteEvidence", FakeRemote), ("Investigator", FakeInvestigator),
                       ("EvidenceRunner", Closable), ("NodeWatch", Closable), ("Act", Closable)):
        monkeypatch.setattr(daemon_module, name, fake)

    def broken(self: object, watcher: object) -> None:
        raise RuntimeError("the loop broke")

    monkeypatch.setattr(daemon_module.Daemon, "one_pass", broken)
    d = daemon_module.Daemon(cfg, tmp_path / "state")
    with pytest.raises(RuntimeError, match="the loop broke"):
        d.run()
    assert [r.closed for r in FakeRemote.built] == [1]


def test_dump_closes_the_remote_evidence(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(evidence_cli, "RemoteEvidence", FakeRemote)
    monkeypatch.setattr(evidence_cli, "Investigator", FakeInvestigator)
    monkeypatch.setattr(evidence_cli, "page_now", lambda http: None)
    with pytest.raises(RuntimeError, match="the capture broke"):
        evidence_cli.cmd_dump(cfg, argparse.Namespace(native=False, out=None, json=True))
    assert [r.closed for r in FakeRemote.built] == [1]
