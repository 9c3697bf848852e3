"""The shipped example config must load, and must say exactly the defaults it claims to."""

from pathlib import Path

from watchdog.config.load import Config, load

ROOT = Path(__file__).resolve().parents[2]


def test_example_config_is_the_defaults() -> None:
    cfg = load(ROOT / "systemd" / "config.example.toml")
    defaults = Config()
    for section in ("engine", "scrape", "judge", "probe", "capture", "incidents", "exporter", "state", "restart",
                    "alerts"):
        assert getattr(cfg, section) == getattr(defaults, section), section
