"""Remove what the host install added (scripts/uninstall runs it): docs/install.md.

It reads the install record (/opt/engine-watchdog/install.json) and removes the unit (stopped and disabled first),
/opt/engine-watchdog, and the system packages the install added, each only where nothing else installed needs it now
(apt's own simulation says). Config, secrets and state stay unless --purge.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from typing import Any

import host_common as hc
from host_common import Failure, say

DROP_INS = hc.UNIT.with_name(hc.UNIT_NAME + ".d")


def parse(argv: list[str]) -> argparse.Namespace:
    p = hc.Parser(prog="scripts/uninstall", description="Remove what scripts/install added (docs/install.md).")
    p.add_argument("--purge", action="store_true",
                   help=f"also remove {hc.ETC} (config, secrets) and {hc.STATE} (events, incidents)")
    return p.parse_args(argv)


def removable(record: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The recorded packages that may go now, and those kept with why."""
    packages = record.get("packages", {})
    recorded, requested = set(packages.get("installed", [])), set(packages.get("requested", []))
    if not recorded:
        return [], {}
    if not hc.has_apt():
        return [], dict.fromkeys(sorted(recorded), "no apt-get here")
    now = hc.installed_packages()
    if recorded - now:
        say(f"packages: already gone: {' '.join(sorted(recorded - now))}")
    manual = hc.manual_packages()
    # A dependency apt added that is marked manual now was installed on purpose since.
    kept = {name: "marked manually installed since" for name in recorded & now if name in manual - requested}
    candidates = (recorded & now) - set(kept)
    changed = True
    while changed:
        changed = False
        for name in sorted(candidates):
            removed = hc.simulated_removals([name])
            if removed is None:
                kept[name] = "apt-get -s remove refuses it"
            elif removed - candidates:
                kept[name] = "needed by " + ", ".join(sorted(removed - candidates)[:4])
            else:
                continue
            candidates.discard(name)
            changed = True
    if candidates:
        together = hc.simulated_removals(sorted(candidates))
        if together is None or together - candidates:
            extra = "refused" if together is None else " ".join(sorted(together - candidates))
            raise Failure(f"apt-get -s remove {' '.join(sorted(candidates))} would remove more: {extra}")
    return sorted(candidates), kept


def remove_packages(record: dict[str, Any]) -> None:
    """Purged, as they were absent before the install; removed, where their config files were left before."""
    names, kept = removable(record)
    for name, why in sorted(kept.items()):
        say(f"packages: kept {name}: {why}")
    had_config = set(record.get("packages", {}).get("had_config", []))
    for verb, group in (("purge", [n for n in names if n not in had_config]),
                        ("remove", [n for n in names if n in had_config])):
        if not group:
            continue
        say(f"packages: apt-get {verb} {' '.join(group)}")
        r = hc.apt_get(verb, "-y", *group)
        if r.returncode != 0:
            say(hc.tail(r.stdout))
            raise Failure(f"apt-get {verb} failed (exit {r.returncode}): {hc.last_line(r.stdout)}")


def remove_unit(purge: bool) -> None:
    """The unit and its template: each running one (engine-watchdog@NAME instances too) stopped and disabled, their
    links and files removed; an operator's drop-ins only with --purge."""
    if hc.systemd_running():
        live = hc.active_units("active,activating,deactivating,reloading")  # one restarting in a loop too
        for unit in dict.fromkeys([hc.UNIT_NAME, *live, *enabled_instances()]):
            r = hc.systemctl("disable", "--now", unit, timeout=300)
            if r is not None and r.returncode == 0:
                say(f"systemd: {unit} stopped and disabled")
    elif hc.UNIT.exists():
        hc.systemctl("disable", hc.UNIT_NAME)  # offline: only its links under /etc/systemd/system
    for pattern in (hc.UNIT_NAME, hc.INSTANCES):
        for link in hc.UNIT.parent.glob(f"*.wants/{pattern}"):
            if link.is_symlink():
                link.unlink()
    for unit in (hc.UNIT, hc.TEMPLATE):
        if unit.exists():
            unit.unlink()
            say(f"removed {unit}")
    for drop_ins in (DROP_INS, *(d for d in hc.UNIT.parent.glob("engine-watchdog@*.service.d") if d.is_dir())):
        if not drop_ins.exists():
            continue
        if purge:
            shutil.rmtree(drop_ins)
            say(f"removed {drop_ins}")
        else:
            say(f"kept {drop_ins} (an operator's drop-ins; --purge removes them)")
    if hc.systemd_running():
        hc.daemon_reload()
        hc.systemctl("reset-failed", hc.UNIT_NAME, hc.INSTANCES)


def enabled_instances() -> list[str]:
    """engine-watchdog@NAME.service instances enabled (linked under a .wants), running or not."""
    return sorted({link.name for link in hc.UNIT.parent.glob(f"*.wants/{hc.INSTANCES}")})


def purge_or_keep(purge: bool) -> None:
    for path in (hc.ETC, hc.STATE):
        if not path.exists():
            continue
        if purge:
            shutil.rmtree(path)
            say(f"removed {path}")
        else:
            say(f"kept {path} (--purge removes it)")


def uninstall(args: argparse.Namespace) -> int:
    record = hc.read_record()
    if record is None:
        if hc.OPT.exists():
            say(f"{hc.OPT} has no install record ({hc.RECORD.name}): not the install's, left as it is")
        left = [path for path in (hc.ETC, hc.STATE) if path.exists()]
        if args.purge and left:
            say("engine-watchdog is not installed here; --purge: removing the config and state it left")
        elif not hc.OPT.exists():
            say(f"engine-watchdog is not installed here (no {hc.RECORD}): nothing to remove")
        purge_or_keep(args.purge)
        return 0
    say(f"engine-watchdog uninstall: {record.get('version', 'an unfinished install')} in {hc.OPT}")
    remove_unit(args.purge)
    remove_packages(record)
    shutil.rmtree(hc.OPT)
    say(f"removed {hc.OPT}")
    purge_or_keep(args.purge)
    say("uninstalled.")
    return 0


def main(argv: list[str]) -> int:
    args = parse(argv)
    hc.require_root()
    try:
        return uninstall(args)
    except Failure as exc:
        hc.fail(str(exc))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
