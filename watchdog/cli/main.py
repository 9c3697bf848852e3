"""The `watchdog` command, the one entry point. Each stage's verbs live with the stage:
check, run, record, replay in `watchdog.cli.service`; dump, explain, incidents, show, report in
`watchdog.cli.evidence`; pause, resume, reset, status in `watchdog.cli.act`; which config file every verb reads
and `config check` in `watchdog.cli.config`."""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata
from typing import Any, NoReturn

from watchdog import __version__
from watchdog.cli import act as operate
from watchdog.cli import config as configuration
from watchdog.cli import evidence as triage
from watchdog.cli import init as starting
from watchdog.cli import nodes
from watchdog.cli import service as watch
from watchdog.cli.version import VersionAction
from watchdog.config.load import Config, ConfigError
from watchdog.service.sdnotify import setup_logging
from watchdog.service.trace import TraceError

log = logging.getLogger(__name__)

EXIT_USAGE, EXIT_SOFTWARE, EXIT_IOERR, EXIT_INTERRUPTED = 64, 70, 74, 130


def clashing_distribution() -> str | None:
    """The unrelated PyPI `watchdog` (filesystem events) shares our import name. Say so if it is installed here."""
    try:
        dist = metadata.distribution("watchdog")
    except metadata.PackageNotFoundError:
        return None
    return f"watchdog {dist.version}"


def _config(args: argparse.Namespace) -> Config:
    cfg = configuration.load_config(args.config)
    engine: dict[str, Any] = {"url": getattr(args, "url", None)}
    state: dict[str, Any] = {"dir": str(args.state_dir) if getattr(args, "state_dir", None) else None}
    exporter: dict[str, Any] = {"port": getattr(args, "metrics_port", None)}
    restart: dict[str, Any] = {"dry_run": True if getattr(args, "dry_run", False) else None}
    return cfg.with_overrides(engine=engine, state=state, exporter=exporter, restart=restart)


class _Parser(argparse.ArgumentParser):
    """Bad arguments exit 64 (EX_USAGE), like a bad config; argparse's own default is 2, which `check` means down."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="watchdog", description="Notices when a vLLM engine stops producing tokens.")
    p.add_argument("--version", action=VersionAction)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, url: bool = True, state_dir: bool = False, as_json: bool = False) -> None:
        sp.add_argument("--config", help=configuration.CONFIG_HELP)
        if url:
            sp.add_argument("--url", help="the vLLM server's base URL, e.g. http://127.0.0.1:8000")
        if state_dir:
            sp.add_argument("--state-dir", help="the service's state directory (default from config)")
        if as_json:
            sp.add_argument("--json", action="store_true", help="machine-readable output")

    watch.add_commands(sub, common, _config)

    d = sub.add_parser("dump", help="capture every engine process's stacks now, write a bundle, print the triage")
    common(d, as_json=True)
    d.add_argument("--out", help="directory for the bundle (default STATE_DIR/incidents)")
    d.add_argument("--native", action="store_true", help="py-spy --native (C/C++ frames too)")
    d.set_defaults(func=lambda a: triage.cmd_dump(_config(a), a))

    ex = sub.add_parser("explain", help="classify stack dumps taken by hand (py-spy text/JSON, --native, faulthandler)")
    ex.add_argument("files", nargs="+")
    ex.add_argument("--json", action="store_true")
    ex.set_defaults(func=triage.cmd_explain)

    inc = sub.add_parser("incidents", help="list incident bundles")
    common(inc, url=False, state_dir=True, as_json=True)
    inc.set_defaults(func=lambda a: triage.cmd_incidents(_config(a), a))

    sh = sub.add_parser("show", help="print one incident's summary (--upstream: a bug report for vLLM's tracker)")
    sh.add_argument("id", help="incident id (or its start), or a bundle directory")
    form = sh.add_mutually_exclusive_group()
    form.add_argument("--upstream", action="store_true",
                      help="Markdown for the engine's issue tracker: versions, topology, verdict, culprit, deciding "
                           "stacks, timeline; no secrets, locals, prompts, logs (docs/upstream-report.md)")
    form.add_argument("--json", action="store_true", help="machine-readable: the manifest and the summary's text")
    sh.add_argument("--keep-addresses", action="store_true",
                    help="with --upstream: keep IP addresses and host names (replaced with <host> by default)")
    common(sh, url=False, state_dir=True)
    sh.set_defaults(func=lambda a: triage.cmd_show(_config(a), a))

    rep = sub.add_parser("report", help="tally verdicts across all incident bundles")
    common(rep, url=False, state_dir=True, as_json=True)
    rep.set_defaults(func=lambda a: triage.cmd_report(_config(a), a))

    operate.add_commands(sub, common, _config)
    nodes.add_commands(sub, common)
    starting.add_parser(sub)
    configuration.add_commands(sub)

    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    clash = clashing_distribution()
    if clash:
        log.warning("the unrelated package %s (filesystem events) is installed in this environment and shares the "
                    "import name 'watchdog'; install engine-watchdog into its own virtual environment", clash)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"watchdog: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TraceError as e:
        print(f"watchdog: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # e.g. a state directory that cannot be created or written
        print(f"watchdog: {e.filename}: {e.strerror or e}" if e.filename else f"watchdog: {e.strerror or e}",
              file=sys.stderr)
        return EXIT_IOERR
    except KeyboardInterrupt:  # Ctrl-C on a verb that takes a while (check, dump, nodes): no traceback
        print("watchdog: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:  # a bug, never "bad config": say so with the traceback (journal under systemd)
        log.exception("watchdog %s: unexpected error (a bug; please report it with this traceback)", __version__)
        return EXIT_SOFTWARE


if __name__ == "__main__":
    sys.exit(main())
