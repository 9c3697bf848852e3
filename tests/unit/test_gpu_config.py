"""The [gpu] section: defaults, validation with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from watchdog.config.gpu import GpuSection, ras_host_port
from watchdog.config.load import ConfigError, load


def _load(tmp_path: Path, text: str) -> object:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return load(p)


def test_defaults_and_a_setting(tmp_path: Path) -> None:
    assert load(None).gpu == GpuSection()
    cfg = _load(tmp_path, '[gpu]\ninterval = 10.0\nras_address = "10.0.0.2:28029"\n')
    assert cfg.gpu.interval == 10.0  # type: ignore[attr-defined]
    assert ras_host_port(cfg.gpu.ras_address) == ("10.0.0.2", 28029)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("text", "words"), [
    ("interval = 0", "gpu.interval must be greater than 0"),
    ("dense_interval = 9.0", "gpu.dense_interval (9) must not exceed gpu.interval (5)"),
    ("spin_power_fraction = 1.5", "gpu.spin_power_fraction must be between 0 and 1"),
    ("busy_util = 0", "gpu.busy_util must be 1..100"),
    ("fr_settle = 120.0", "gpu.fr_settle must be at most 60"),
    ('ras_address = "localhost"', "gpu.ras_address must be host:port"),
    ('ras_address = "h:99999"', "gpu.ras_address must be host:port"),
    ("ras = 1", "gpu.ras: expected true or false"),
    ("colour = 1", "unknown key gpu.colour"),
])
def test_errors_name_the_key(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=None) as e:
        _load(tmp_path, f"[gpu]\n{text}\n")
    assert words in str(e.value)
