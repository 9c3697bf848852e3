"""What the daemon and `watchdog dump` build for the other nodes (one ssh link per node: its master and temp dir) is
built once, shared by every stage that talks to a node, and closed once when they end, however they end."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, ClassVar

import pytest

from watchdog.cli import evidence as evidence_cli
from watchdog.config.load import Config, load
from watchdog.config.nodes import NodeSection
from watchdog.service import compose as compose_module
from watchdog.service import daemon as daemon_module

NODE = '[[nodes]]\nname = "worker1"\nhost = "10.0.0.2"\nidentity_file = "/k"\nknown_hosts_file = "/kh"\n'


class Links:
    """`open_links` and `close_links` stood in for: which dicts were opened, which closed."""

    opened: ClassVar[list[dict[str, object]]] = []
    closed: ClassVar[list[dict[str, object]]] = []

    @staticmethod
    def open(nodes: tuple[NodeSection, ...]) -> dict[str, object]:
        Links.opened.append({n.name: object() for n in nodes})
        return Links.opened[-1]

    @staticmethod
    def close(links: dict[str, object]) -> None:
        Links.closed.append(links)


class Given:
    """A stage stood in for that keeps the links it was handed."""

    links: ClassVar[list[object]] = []

    def __init__(self, *args: object, **__: object) -> None:
        Given.links.extend(a for a in args if isinstance(a, dict) and "worker1" in a)

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass

    def views(self) -> list[object]:
        return []

    def delivering(self) -> list[tuple[str, str, bool]]:
        return []


class FakeInvestigator:
    def __init__(self, cfg: Config, http: object, gpu: object = None, others: object = None,
                 reading: object = None) -> None:
        self.others = others
        self.incidents_dir = Path("/nonexistent")

    def preflight(self) -> list[str]:
        return []

    def investigate(self, **_: Any) -> None:
        raise RuntimeError("the capture broke")


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    Links.opened.clear()
    Links.closed.clear()
    Given.links.clear()
    p = tmp_path / "w.toml"
    p.write_text('[engine]\nurl = "http://127.0.0.1:9"\n[gpu]\nenabled = false\n[exporter]\nport = 0\n' + NODE)
    return load(p)


def test_the_daemon_shares_one_link_per_node_and_closes_it(cfg: Config, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def node_runners(links: dict[str, object]) -> dict[str, object]:
        Given.links.append(links)
        return {}

    for name, fake in (("RemoteEvidence", Given), ("Investigator", FakeInvestigator), ("EvidenceRunner", Given),
                       ("NodeWatch", Given), ("node_runners", node_runners), ("open_links", Links.open),
                       ("close_links", Links.close)):
        monkeypatch.setattr(compose_module, name, fake)

    def broken(self: object, watcher: object) -> None:
        raise RuntimeError("the loop broke")

    monkeypatch.setattr(daemon_module.Daemon, "one_pass", broken)
    d = daemon_module.Daemon(cfg, tmp_path / "state")
    with pytest.raises(RuntimeError, match="the loop broke"):
        d.run()
    assert len(Links.opened) == len(Links.closed) == 1 and Links.closed[0] is Links.opened[0]
    # the act stage (restart's runners), the evidence (capture) and the liveness watch: each handed the same links
    assert len(Given.links) == 3 and all(x is Links.opened[0] for x in Given.links)


def test_dump_closes_the_links(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(evidence_cli, "RemoteEvidence", Given)
    monkeypatch.setattr(evidence_cli, "Investigator", FakeInvestigator)
    monkeypatch.setattr(evidence_cli, "page_now", lambda http: None)
    monkeypatch.setattr(evidence_cli, "open_links", Links.open)
    monkeypatch.setattr(evidence_cli, "close_links", Links.close)
    with pytest.raises(RuntimeError, match="the capture broke"):
        evidence_cli.cmd_dump(cfg, argparse.Namespace(native=False, out=None, json=True))
    assert len(Links.opened) == len(Links.closed) == 1 and Links.closed[0] is Links.opened[0]
    assert len(Given.links) == 1 and Given.links[0] is Links.opened[0]
