"""A throwaway systemd: PID 1 of its own PID, mount, UTS, IPC, network and cgroup namespaces, for tests.

    with ThrowawaySystemd("e2e", {"engine.service": ENGINE_UNIT}) as sd:
        sd.wait_active("engine.service")
        sd.systemctl("restart", "engine.service")
        sd.run([python, "-c", "..."])          # runs inside all of its namespaces

How it is kept from touching the machine (a systemd booted into the default target here once ran
systemd-tmpfiles and emptied the machine's real /tmp):

- `unshare --fork --pid --mount --uts --ipc --net --cgroup --mount-proc` runs this file as a boot program
  that, before systemd starts, makes every mount private and mounts fresh tmpfs on /run, /tmp, /var/tmp,
  /dev/shm, /var/log/journal and /etc/systemd/system (the machine's enabled units stay out), makes /sys and
  /proc/sys read-only, binds /dev/null over /dev/console and /dev/kmsg, and mounts a cgroup2 hierarchy
  rooted at a cgroup of its own (created below the caller's, removed at the end), so systemd never moves
  itself or anything else in the machine's cgroup trees;
- systemd boots into a target of its own (`DefaultDependencies=no`, `Wants=` the units under test); every
  unit under test gets a drop-in with `DefaultDependencies=no` (plus `Conflicts=`/`Before=shutdown.target`,
  so `stop()` stops them cleanly), and every other service, socket, target, timer and path unit installed
  on the machine is masked (sysinit.target, basic.target and systemd-tmpfiles-* included), except journald
  and what `systemctl exit` needs;
- journald runs with `Storage=volatile` (the journal lives in the namespace's /run);
- the unshare process runs in its own session (its pid is the process group id); `stop()` asks systemd to
  exit, else SIGKILLs it (which ends its PID namespace), then that process group and the namespace's own
  cgroup, so nothing it started survives.

Paths outside the private mounts are the machine's own files (the mount namespace is a copy): a unit can
run the checkout's venv python and read the checkout. Directories under a private mount that units need
(e.g. a pytest tmp_path under /tmp) can be passed as `keep`: they are bind-mounted back inside.

Pids from `main_pid()` and `systemctl` are the namespace's own; `host_pid()` translates one for signals
sent from the test.

`root=DIR` boots an OS tree instead (an unpacked Debian root, tests/harness/debian_root.py): the boot program mounts
a fresh /proc, the machine's /dev and a read-only /sys (the cgroup2 tree rooted as above) inside DIR, the same
private tmpfs mounts there, then `pivot_root`s into DIR and unmounts the machine's tree, so the root's own
/lib/systemd/systemd runs with nothing of the machine's files in reach; `run()` lands inside it. The root's own
units are masked (those under its /usr/lib, /lib and /usr/local/lib), except `root_units` (say, a unit an install
put in its /etc/systemd/system), which get the same drop-in as `units`; its /etc/systemd/system stays its own, so
`systemctl enable` there works on the root's files. `files`, `keep` and `binds` are paths inside the root.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

SYSTEMD = "/lib/systemd/systemd"
REQUIRED_TOOLS = ("unshare", "nsenter", "systemctl", "journalctl")
# Mounted fresh (tmpfs) inside the namespace, when they exist on the machine; "/run" and "/tmp" always.
PRIVATE_MOUNTS = ("/run", "/tmp", "/var/tmp", "/dev/shm", "/var/log/journal", "/etc/systemd/system")
UNIT_DIRS = ("/usr/lib/systemd/system", "/lib/systemd/system", "/usr/local/lib/systemd/system")
MASKED_SUFFIXES = (".service", ".socket", ".target", ".timer", ".path")
# Installed units left unmasked: the journal and what `systemctl exit` / `poweroff` pull in.
NOT_MASKED = frozenset(
    {
        "systemd-journald.service",
        "systemd-journald.socket",
        "exit.target",
        "systemd-exit.service",
        "shutdown.target",
        "umount.target",
        "final.target",
        "poweroff.target",
        "systemd-poweroff.service",
        "halt.target",
        "systemd-halt.service",
    }
)
# Replaces systemd-exit.service: the same, minus umount.target.
EXIT_SERVICE = """\
[Unit]
Description=Exit the throwaway systemd (its mounts end with its namespace)
DefaultDependencies=no
Requires=shutdown.target final.target
After=shutdown.target final.target
SuccessAction=exit-force
"""
RUNNING_STATES = ("running", "degraded")
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
UNIT_NAME_RE = re.compile(r"^[A-Za-z0-9:_.@\\-]+\.(service|socket|target|timer|path|mount|slice)$")

# pivot_root(2), which the C library does not wrap; umount2(2)'s MNT_DETACH
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
MNT_DETACH = 2
# mount(2) flags (linux/fs.h)
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


class SystemdNsError(RuntimeError):
    """The throwaway systemd could not be started, or a unit in it did not do what was asked."""


def available(root: str | os.PathLike[str] | None = None) -> str | None:
    """None when this machine can run a throwaway systemd (booting `root`'s own, if given), else why not (tests fail
    with it, never skip)."""
    if os.geteuid() != 0:
        return "a throwaway systemd needs root (namespaces, mounts, cgroups)"
    if root is not None and platform.machine() not in SYS_PIVOT_ROOT:
        return f"booting a root: no pivot_root syscall number known for {platform.machine()}"
    systemd = SYSTEMD if root is None else os.path.join(root, SYSTEMD.lstrip("/"))
    if not os.access(systemd, os.X_OK):
        return f"no {systemd}: install the apt package 'systemd'" + ("" if root is None else " in the root")
    tools = REQUIRED_TOOLS if root is None else REQUIRED_TOOLS[:2]  # systemctl and journalctl: the root's own
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt packages util-linux and systemd)"
    if not Path("/proc/self/ns/cgroup").exists():
        return "the kernel has no cgroup namespaces"
    try:
        _own_cgroup2_dir()
    except SystemdNsError as exc:
        return str(exc)
    return None


def _own_cgroup2_dir() -> Path:
    """This process's cgroup in the machine's cgroup2 (unified) hierarchy."""
    mount_point = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if right.split()[0] == "cgroup2" and fields[3] == "/":
                mount_point = fields[4]
                break
    if mount_point is None:
        raise SystemdNsError("no cgroup2 hierarchy mounted (a throwaway systemd needs one for its cgroup namespace)")
    with open("/proc/self/cgroup") as f:
        path = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
    if path is None:
        raise SystemdNsError("this process is in no cgroup2 cgroup (/proc/self/cgroup has no 0:: line)")
    own = Path(mount_point + path.rstrip("/"))
    if not own.is_dir():
        raise SystemdNsError(f"cgroup2 directory {own} not found")
    return own


def _start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (after the command name, which may hold spaces), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def _wait_gone(pid: int, start: int | None, timeout: float) -> bool:
    """Wait until the process `pid` that started at `start` has exited (a zombie counts as exited)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            after_name = stat.rpartition(")")[2].split()
            if after_name[0] in ("Z", "X") or int(after_name[19]) != start:
                return True
        except (OSError, IndexError, ValueError):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _under(path: str, parents: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def _quote_env(key: str, value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) or "\n" in value:
        raise ValueError(f"environment variable {key!r} cannot be passed to units")
    return '"' + f"{key}={value}".replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def unit_name_for_path(path: str, suffix: str = ".mount") -> str:
    """`systemd-escape --path --suffix=mount PATH`."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        return "-" + suffix
    out = []
    for i, ch in enumerate("/".join(parts)):
        if ch == "/":
            out.append("-")
        elif (ch.isascii() and ch.isalnum()) or ch in ":_" or (ch == "." and i > 0):
            out.append(ch)
        else:
            out.append("".join(f"\\x{b:02x}" for b in ch.encode()))
    return "".join(out) + suffix


class ThrowawaySystemd:
    """One throwaway systemd; see the module doc. `start()`/`stop()` or use it as a context manager.

    units: unit file name -> text, written to /run/systemd/system/ inside.
    wanted: the units the boot target pulls in (default: all of `units` except templates).
    files: absolute path -> text, written inside before systemd starts; only under the private mounts
        (/run, /tmp, /var/tmp, /dev/shm) or `private_dirs`. A text starting with "#!" is made executable.
    env: DefaultEnvironment= for every unit inside.
    private_dirs: more existing directories to cover with an empty tmpfs inside (e.g. "/var/lib").
    keep: directories under a private mount to bind back inside (the checkout and venv are kept anyway).
    log_dir: where the boot log (systemd's own output until journald runs) goes; a temporary directory,
        removed by `stop()`, if not given.
    root: an OS tree to boot instead of the machine's files (see the module doc).
    root_units: with `root`, units of the root's own the test uses: neither masked nor written, given the drop-in.
    """

    def __init__(
        self,
        name: str,
        units: Mapping[str, str],
        *,
        wanted: Sequence[str] | None = None,
        files: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        private_dirs: Sequence[str] = (),
        keep: Sequence[str | os.PathLike[str]] = (),
        binds: Mapping[str, str] | None = None,
        journald: bool = True,
        log_dir: str | os.PathLike[str] | None = None,
        root: str | os.PathLike[str] | None = None,
        root_units: Sequence[str] = (),
    ) -> None:
        if not NAME_RE.match(name):
            raise ValueError(f"name {name!r}: letters, digits, '_', '.', '-' only")
        self.name = name
        self.target = f"throwaway-{name}.target"
        self.units = dict(units)
        for unit in self.units:
            if not UNIT_NAME_RE.match(unit):
                raise ValueError(f"unit name {unit!r}: not a unit file name (foo.service, foo@.service, ...)")
        if self.target in self.units:
            raise ValueError(f"{self.target} is the harness's own boot target")
        self.wanted = list(wanted) if wanted is not None else [u for u in self.units if "@." not in u]
        self.root = None if root is None else Path(root).resolve()
        self.root_units = list(root_units)
        if self.root_units and self.root is None:
            raise ValueError("root_units: only with root=")
        for unit in self.root_units:
            if not UNIT_NAME_RE.match(unit) or unit in self.units:
                raise ValueError(f"root_units: {unit!r} is not a unit file name, or is in units as well")
        self.private_dirs = [os.path.abspath(p) for p in private_dirs]
        self.files = {os.path.abspath(p): text for p, text in (files or {}).items()}
        allowed = [*PRIVATE_MOUNTS[:4], *self.private_dirs]
        for path in self.files:
            if not _under(path, allowed) or path in allowed:
                raise ValueError(f"{path}: files may only be written under {', '.join(allowed)}")
        self.env = dict(env or {})
        for key, value in self.env.items():
            _quote_env(key, value)
        checkout = Path(__file__).resolve().parents[2]
        if self.root is None:
            self.keep = sorted({str(Path(p).resolve()) for p in (*keep, checkout, sys.prefix, sys.base_prefix)})
        else:  # paths inside the root; the checkout is not shown there (the root has programs of its own)
            self.keep = sorted({os.path.abspath(p) for p in keep})
        # a real directory shown at a second place inside (under a private mount), e.g. the checkout outside /tmp
        # for a unit with PrivateTmp=, which hides everything under /tmp, kept binds included
        source = os.path.abspath if self.root is not None else (lambda p: str(Path(p).resolve()))  # inside a root
        self.binds = {source(src): os.path.abspath(dst) for src, dst in (binds or {}).items()}
        for dst in self.binds.values():
            if not _under(dst, [*PRIVATE_MOUNTS[:4], *self.private_dirs]):
                raise ValueError(f"binds: {dst} must be under a private mount")
        self.journald = journald
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="throwaway-systemd-"))
        self.boot_log_path = self.log_dir / f"{name}-boot.log"
        self.state = ""  # `systemctl is-system-running` when start() returned
        self.boot_seconds = 0.0
        self._popen: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._pid_start: int | None = None  # its start time (clock ticks), so a reused pid is not taken for it
        self._cgroup: Path | None = None
        self._stopped = False

    # ----------------------------------------------------------------- lifecycle

    @property
    def pgid(self) -> int:
        """The unshare process's pid, which is also its session id and process group id."""
        if self._popen is None:
            raise RuntimeError("not started")
        return self._popen.pid

    @property
    def pid(self) -> int:
        """The namespace's systemd (PID 1 inside), as a pid of the machine."""
        if self._pid is None:
            raise RuntimeError("not started")
        return self._pid

    @property
    def cgroup_dir(self) -> Path | None:
        """The namespace's own cgroup (the root of its cgroup namespace) in the machine's cgroup2 tree."""
        return self._cgroup

    @property
    def unshare_exit_code(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def start(self, timeout: float = 30.0) -> ThrowawaySystemd:
        """Boot it and wait (at most `timeout` s) until `systemctl is-system-running` says running or degraded."""
        if self._popen is not None:
            raise RuntimeError("already started")
        reason = available(self.root)
        if reason is not None:
            raise SystemdNsError(f"cannot run a throwaway systemd here: {reason}")
        started = time.monotonic()
        deadline = started + timeout
        try:
            self._launch()
            self._pid = self._wait_for_systemd(deadline)
            self.state = self._wait_running(deadline)
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop(timeout=10.0)
            raise
        self.boot_seconds = time.monotonic() - started
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """`systemctl exit` inside, then wait; past `timeout` SIGKILL systemd (its PID namespace goes with it).

        Idempotent. Afterwards no process of the namespace is left and its cgroup is removed.
        """
        if self._popen is None or self._stopped:
            return
        deadline = time.monotonic() + timeout
        try:
            if self._popen.poll() is None and self._pid is not None:
                with contextlib.suppress(Exception):
                    self.systemctl("--no-block", "exit", "0", timeout=max(1.0, min(10.0, timeout / 3)), check=False)
            else:
                deadline = time.monotonic()  # systemd never answered: nothing to wait for
            try:
                self._popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # SIGKILL to the namespace's PID 1 from outside: the kernel ends its whole PID namespace, and
                # unshare (still alive) reaps it and exits. systemd runs in a session of its own, so the
                # process group below would not reach it.
                grace = 0.1
                if self._pid is not None and _start_time(self._pid) == self._pid_start:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self._pid, signal.SIGKILL)
                        grace = 15.0
                try:
                    self._popen.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    # Not reaped yet, so the group id is still ours alone.
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self._popen.pid, signal.SIGKILL)
                    self._kill_cgroup()
                    self._popen.wait(timeout=15.0)
            # systemd is gone only once every process of its PID namespace is (it waits for them as it exits)
            if self._pid is not None and not _wait_gone(self._pid, self._pid_start, 15.0):
                self._kill_cgroup()
                if not _wait_gone(self._pid, self._pid_start, 15.0):
                    raise SystemdNsError(f"{self.name}: systemd (pid {self._pid}) still alive after SIGKILL")
        finally:
            if self._popen.returncode is not None:
                self._stopped = True
                self._remove_cgroup()
                if self._own_log_dir:
                    shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> ThrowawaySystemd:
        if self._popen is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ----------------------------------------------------------------- inside

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 30.0,
        *,
        check: bool = False,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside all the namespaces (`nsenter -t PID -a`); on timeout its whole group is killed."""
        cmd = ["nsenter", "-t", str(self.pid), "-a", "--", *argv]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # unreaped: the group id is still ours
            proc.communicate()
            raise
        result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, cmd, out, err)
        return result

    def systemctl(self, *args: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", "--no-pager", *args], timeout=timeout, check=check)

    def show(self, unit: str, prop: str, timeout: float = 30.0) -> str:
        return self.systemctl("show", "-p", prop, "--value", unit, timeout=timeout).stdout.strip()

    def main_pid(self, unit: str) -> int:
        """The unit's MainPID as seen inside the namespace (0 when it has none)."""
        return int(self.show(unit, "MainPID") or 0)

    def host_pid(self, ns_pid: int) -> int:
        """The machine's pid of a process that has `ns_pid` inside the namespace."""
        ns = os.readlink(f"/proc/{self.pid}/ns/pid")
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != ns:
                    continue
                with open(f"/proc/{entry}/status") as f:
                    nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
            except (OSError, StopIteration):
                continue
            if int(nspid[-1]) == ns_pid:
                return int(entry)
        raise ProcessLookupError(f"no process with pid {ns_pid} in {self.name}'s namespace")

    def active_state(self, unit: str) -> str:
        return self.systemctl("is-active", unit, check=False).stdout.strip()

    def is_active(self, unit: str) -> bool:
        return self.active_state(unit) == "active"

    def wait_active(self, unit: str, timeout: float = 30.0) -> int:
        """Wait until the unit is active; return its MainPID (inside). Raises at once if it failed."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.active_state(unit)
            if state == "active":
                return self.main_pid(unit)
            if state == "failed":
                raise SystemdNsError(f"{unit} failed in {self.name}:\n{self.status(unit)}\n{self.journal(unit)}")
            time.sleep(0.1)
        raise TimeoutError(
            f"{unit} not active after {timeout:.0f} s (last: {state}) in {self.name}:\n"
            f"{self.status(unit)}\n{self.journal(unit)}"
        )

    def status(self, unit: str, lines: int = 0) -> str:
        r = self.systemctl("status", "--full", "-n", str(lines), unit, check=False)
        return r.stdout + r.stderr

    def journal(self, unit: str | None = None, lines: int = 50) -> str:
        """The last lines of the namespace's journal (of one unit if given); `systemctl status` without journald."""
        if self.journald and self.is_active("systemd-journald.service"):
            argv = ["journalctl", "--no-pager", "--no-hostname", "-o", "short-precise", "-n", str(lines)]
            r = self.run([*argv, *(["-u", unit] if unit else [])], check=False)
            if r.returncode == 0:
                return r.stdout
        return self.status(unit, lines) if unit else self.systemctl("status", check=False).stdout

    def read_file(self, path: str, timeout: float = 30.0) -> str:
        return self.run(["cat", path], timeout=timeout, check=True).stdout

    def boot_log(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.boot_log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    # ----------------------------------------------------------------- internals

    def _launch(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        spec_path = self.log_dir / f"{self.name}-spec.json"
        spec_path.write_text(json.dumps(self._spec()))
        self._cgroup = _own_cgroup2_dir() / f"throwaway-systemd-{self.name}-{os.getpid()}-{time.monotonic_ns()}"
        self._cgroup.mkdir()
        python = sys.executable
        unshare = [
            "unshare", "--fork", "--pid", "--mount", "--uts", "--ipc", "--net", "--cgroup", "--mount-proc",
            "--propagation", "private", "--kill-child=SIGKILL",
            python, __file__, "boot", str(spec_path),
        ]  # fmt: skip
        with open(self.boot_log_path, "ab") as log:
            self._popen = subprocess.Popen(
                [python, __file__, "launch", str(self._cgroup), *unshare],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C.UTF-8"},
            )

    def _host(self, inside: str) -> str:
        """Where a path of the namespace's file system is on the machine (the same path without `root`)."""
        return inside if self.root is None else os.path.join(self.root, inside.lstrip("/"))

    def _spec(self) -> dict[str, object]:
        masks: list[str] = []
        for d in UNIT_DIRS:
            with contextlib.suppress(FileNotFoundError):
                masks.extend(
                    e
                    for e in os.listdir(self._host(d))
                    if e.endswith(MASKED_SUFFIXES) and e not in NOT_MASKED and e not in self.units
                    and e not in self.root_units
                )
        # a root's /etc/systemd/system is its own (a throwaway tree's), where the units under test may be installed
        mounts = PRIVATE_MOUNTS if self.root is None else PRIVATE_MOUNTS[:-1]
        # /dev is the machine's in both cases
        private = [p for p in mounts if p in ("/run", "/tmp") or os.path.isdir(p if p == "/dev/shm" else self._host(p))]
        return {
            "root": None if self.root is None else str(self.root),
            "root_units": self.root_units,
            "name": self.name,
            "target": self.target,
            "units": self.units,
            "wanted": self.wanted,
            "files": self.files,
            "default_environment": " ".join(_quote_env(k, v) for k, v in self.env.items()),
            "private_mounts": [*private, *self.private_dirs],
            "keep": self._kept(private),
            "binds": self.binds,
            "journald": self.journald,
            "masks": sorted(set(masks)),
        }

    def _kept(self, private: list[str]) -> list[str]:
        covered = [*private, *self.private_dirs]
        for path in self.keep:
            if path in covered:
                raise ValueError(f"keep={path!r} would undo a private mount; keep a directory below it")
        return [p for p in self.keep if _under(p, covered)]

    def _wait_for_systemd(self, deadline: float) -> int:
        assert self._popen is not None
        children = f"/proc/{self._popen.pid}/task/{self._popen.pid}/children"
        while time.monotonic() < deadline:
            if self._popen.poll() is not None:
                raise SystemdNsError(
                    f"{self.name}: the namespace exited ({self._popen.returncode}) before systemd ran; "
                    f"boot log:\n{self.boot_log()}"
                )
            with contextlib.suppress(OSError, ValueError):
                cmdline = Path(f"/proc/{self._popen.pid}/cmdline").read_bytes().split(b"\0")
                if cmdline[0].endswith(b"unshare"):  # the launcher has exec'd unshare
                    kids = Path(children).read_text().split()
                    if kids and os.path.samefile(f"/proc/{kids[0]}/exe", self._host(SYSTEMD)):
                        self._pid_start = _start_time(int(kids[0]))
                        return int(kids[0])
            time.sleep(0.05)
        raise SystemdNsError(f"{self.name}: systemd did not start in time; boot log:\n{self.boot_log()}")

    def _wait_running(self, deadline: float) -> str:
        assert self._popen is not None
        state = "no answer yet"
        while time.monotonic() < deadline:
            if self._popen.poll() is not None:
                raise SystemdNsError(
                    f"{self.name}: systemd exited ({self._popen.returncode}) while booting; "
                    f"boot log:\n{self.boot_log()}"
                )
            with contextlib.suppress(subprocess.TimeoutExpired):
                r = self.systemctl("is-system-running", timeout=max(1.0, min(5.0, deadline - time.monotonic())),
                                   check=False)  # fmt: skip
                state = (r.stdout.strip() or r.stderr.strip()).splitlines()[-1] if (r.stdout or r.stderr) else "?"
                if state in RUNNING_STATES:
                    return state
            time.sleep(0.1)
        detail = ""
        with contextlib.suppress(Exception):
            detail = (
                self.systemctl("list-jobs", check=False, timeout=5).stdout
                + self.systemctl("--failed", check=False, timeout=5).stdout
                + self.journal(lines=40)
            )
        raise SystemdNsError(
            f"{self.name}: not running in time (last is-system-running: {state});\n{detail}\n"
            f"boot log:\n{self.boot_log()}"
        )

    def _cgroup_pids(self) -> list[int]:
        if self._cgroup is None or not self._cgroup.is_dir():
            return []
        pids: list[int] = []
        for d, _, _ in os.walk(self._cgroup):
            with contextlib.suppress(FileNotFoundError):
                pids.extend(int(p) for p in Path(d, "cgroup.procs").read_text().split())
        return pids

    def _kill_cgroup(self) -> None:
        """SIGKILL every process in the namespace's own cgroup (which holds nothing but the namespace)."""
        if self._cgroup is None or not self._cgroup.is_dir():
            return
        kill_file = self._cgroup / "cgroup.kill"
        if kill_file.exists():
            with contextlib.suppress(OSError):
                kill_file.write_text("1")
        else:
            for pid in self._cgroup_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _remove_cgroup(self) -> None:
        if self._cgroup is None or not self._cgroup.is_dir():
            return
        deadline = time.monotonic() + 10.0
        while self._cgroup_pids() and time.monotonic() < deadline:
            self._kill_cgroup()
            time.sleep(0.1)
        for d, _, _ in os.walk(self._cgroup, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(d)

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else (self.state or "not started")
        return f"<ThrowawaySystemd {self.name} pid={self._pid} {state}>"


# --------------------------------------------------------------------- the boot program (inside the namespaces)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target} ({fstype}, flags {flags:#x}): {os.strerror(err)}")


def _write(path: str, text: str, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def _mount_root(top: str) -> None:  # pragma: no cover - runs as PID 1 of the new namespaces
    """A root's own mount point (for pivot_root) with a fresh /proc, the machine's /dev and a read-only /sys."""
    _mount(top, top, None, MS_BIND | MS_REC)
    _mount("proc", f"{top}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's
    _mount("/sys", f"{top}/sys", None, MS_BIND | MS_REC)
    _mount("/dev", f"{top}/dev", None, MS_BIND | MS_REC)


def _pivot(top: str) -> None:  # pragma: no cover - runs as PID 1 of the new namespaces
    """Make `top` the namespace's / and unmount the machine's tree from it (pivot_root(2)'s ".", "." idiom)."""
    libc = ctypes.CDLL(None, use_errno=True)
    os.chdir(top)
    if libc.syscall(SYS_PIVOT_ROOT[platform.machine()], b".", b".") != 0:
        raise OSError(ctypes.get_errno(), f"pivot_root into {top}: {os.strerror(ctypes.get_errno())}")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), f"unmounting the machine's tree: {os.strerror(ctypes.get_errno())}")
    os.chdir("/")


def _boot(spec_path: str) -> None:  # pragma: no cover - runs as PID 1 of the new namespaces
    """Set up the namespace (see the module doc), then exec systemd into the harness's own target."""
    with open(spec_path) as f:
        spec = json.load(f)  # read before /tmp is covered
    if os.getpid() != 1:
        raise SystemExit("boot: not PID 1 of a new PID namespace; refusing to touch any mount")
    top = spec.get("root") or ""  # paths below are the namespace's own: at top + path until the pivot

    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    if top:
        _mount_root(top)
    kept = {p: os.open(top + p, os.O_PATH | os.O_DIRECTORY) for p in spec["keep"]}  # reachable once covered
    bound = {dst: os.open(top + src, os.O_PATH | os.O_DIRECTORY) for src, dst in spec.get("binds", {}).items()}
    _mount(f"{top}/proc/sys", f"{top}/proc/sys", None, MS_BIND)
    _mount(None, f"{top}/proc/sys", None, MS_REMOUNT | MS_BIND | MS_RDONLY)  # this mount only, not the superblock
    _mount(None, f"{top}/sys", None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    _mount("cgroup2", f"{top}/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV)  # rooted at our own cgroup
    for path in sorted(spec["private_mounts"], key=lambda p: p.rstrip("/").count("/")):  # parents first
        mode = "1777" if path in ("/tmp", "/var/tmp", "/dev/shm") else "0755"
        _mount("tmpfs", top + path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode}")
    for dev in ("/dev/console", "/dev/kmsg"):
        if os.path.exists(top + dev):
            _mount("/dev/null", top + dev, None, MS_BIND)
    for path, fd in [*kept.items(), *bound.items()]:
        os.makedirs(top + path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", top + path, None, MS_BIND | MS_REC)
        os.close(fd)

    unit_dir = f"{top}/run/systemd/system"
    wants = (["systemd-journald.service"] if spec["journald"] else []) + spec["wanted"]
    _write(
        f"{unit_dir}/{spec['target']}",
        f"[Unit]\nDescription=throwaway systemd {spec['name']}\nDefaultDependencies=no\nAllowIsolate=yes\n"
        + "".join(f"Wants={u}\n" for u in wants),
    )
    after_journal = "After=systemd-journald.socket\n" if spec["journald"] else ""
    for unit, text in [*spec["units"].items(), *((u, None) for u in spec.get("root_units", []))]:
        if text is not None:
            _write(f"{unit_dir}/{unit}", text)
        _write(
            f"{unit_dir}/{unit}.d/00-throwaway.conf",
            "[Unit]\nDefaultDependencies=no\nConflicts=shutdown.target\nBefore=shutdown.target\n" + after_journal,
        )
    # `systemctl exit` without umount.target, and the boot's own mounts never unmounted (by poweroff either):
    # an unmounted /tmp or /run inside would show the machine's own to whatever still runs there.
    _write(f"{unit_dir}/systemd-exit.service", EXIT_SERVICE)
    for path in [*spec["private_mounts"], *kept, "/proc/sys", "/dev/console", "/dev/kmsg"]:
        _write(f"{unit_dir}/{unit_name_for_path(path)}.d/00-throwaway.conf", "[Unit]\nDefaultDependencies=no\n")
    for unit in spec["masks"]:
        os.symlink("/dev/null", f"{unit_dir}/{unit}")
    manager = "[Manager]\nShowStatus=no\nDefaultTimeoutStopSec=15s\n"
    if spec["default_environment"]:
        manager += f"DefaultEnvironment={spec['default_environment']}\n"
    _write(f"{top}/run/systemd/system.conf.d/50-throwaway.conf", manager)
    _write(
        f"{top}/run/systemd/journald.conf.d/50-throwaway.conf",
        "[Journal]\nStorage=volatile\nReadKMsg=no\nForwardToSyslog=no\nForwardToKMsg=no\nForwardToConsole=no\n"
        "ForwardToWall=no\nRateLimitIntervalSec=0\nRuntimeMaxUse=64M\n",
    )
    for path, text in spec["files"].items():
        if not any(path.startswith(p.rstrip("/") + "/") for p in spec["private_mounts"]):
            raise SystemExit(f"boot: {path} is not under a private mount; refusing to write it")
        _write(top + path, text, 0o755 if text.startswith("#!") else 0o644)

    if shutil.which("ip"):  # systemd brings lo up as well
        subprocess.run(["ip", "link", "set", "lo", "up"], check=False, timeout=10)
    if top:
        _pivot(top)
    argv = [
        SYSTEMD, "--system", f"--unit={spec['target']}", "--show-status=no",
        f"--log-target={'journal' if spec['journald'] else 'console'}",
    ]  # fmt: skip
    env = {
        "container": f"throwaway-{spec['name']}",
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    }
    sys.stdout.flush()
    os.execve(SYSTEMD, argv, env)


def _launch(cgroup: str, argv: list[str]) -> None:  # pragma: no cover - runs as the unshare process
    """Join the namespace's own cgroup, then become `unshare` (whose --cgroup roots the namespace there)."""
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "boot":
        _boot(sys.argv[2])
    elif len(sys.argv) > 3 and sys.argv[1] == "launch":
        _launch(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} boot SPEC.json | launch CGROUP_DIR ARGV...")
