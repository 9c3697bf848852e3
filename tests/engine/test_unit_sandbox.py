"""What the shipped unit's sandbox lets the watchdog do, tried for real in a throwaway systemd.

A probe (tests/harness/sandbox_probe.py) runs under every sandboxing line of systemd/engine-watchdog.service's
[Service] section (only what starts and restarts the watchdog is left out, and the test checks that nothing else
is), and does what the watchdog does: py-spy (with --native too) on a root engine, on another user's, on one in a
mount and PID namespace of its own whose files the host cannot see (a container's); a signal to another user's
process (a command step's kill); systemctl restarting another unit; the Docker CLI restarting a container over
/run/docker.sock (a fake Engine API); ssh through a shared connection to a real sshd on loopback, with the key and
known_hosts the nodes use; the /dev/shm sweep removing another user's stale segment; a write to a Flight Recorder
pipe on the read-only /run; the journal; NVML when there is a GPU. Every check must pass. No vLLM needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.harness.shipped_unit import ALIAS, CHECKOUT, HIDDEN, SHIPPED, STATE, service_settings, shipped_systemd

PROBE_SOURCE = CHECKOUT / "tests" / "harness" / "sandbox_probe.py"
PROBE = "/run/probe/sandbox_probe.py"
PYTHON = str(Path(sys.executable).resolve()) if HIDDEN else sys.executable
PYSPY = f"{ALIAS}/bin/py-spy" if HIDDEN else str(Path(sys.prefix) / "bin" / "py-spy")
PATHS = [f"{ALIAS}/src", f"{ALIAS}/site-packages"] if HIDDEN else [str(CHECKOUT)]
RESULTS = f"{STATE}/probe.json"
# the lines that start, stop and restart the watchdog itself; every other [Service] line is the sandbox
NOT_SANDBOX = {"Type", "WatchdogSec", "NotifyAccess", "ExecStartPre", "ExecStart", "Restart", "RestartSec",
               "RestartPreventExitStatus", "EnvironmentFile"}
SSHD_CONFIG = """\
ListenAddress 127.0.0.1
Port 2222
HostKey /run/probe/host_key
PidFile /run/probe/sshd.pid
AuthorizedKeysFile /run/probe/authorized_keys
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
PasswordAuthentication no
KbdInteractiveAuthentication no
"""


def probe_unit() -> str:
    settings = service_settings(SHIPPED.read_text())
    left_out = {key for key, _ in settings if key in NOT_SANDBOX}
    assert left_out == NOT_SANDBOX, f"the shipped unit no longer has {NOT_SANDBOX - left_out}: update NOT_SANDBOX"
    sandbox = [f"{key}={value}" for key, value in settings if key not in NOT_SANDBOX]
    argv = [PYTHON, PROBE, "probe", RESULTS, PYSPY, *PATHS]
    return "[Service]\nType=oneshot\n" + "".join(f"{line}\n" for line in sandbox) + f"ExecStart={' '.join(argv)}\n"


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True,
                   timeout=60, start_new_session=True, capture_output=True)


def test_the_shipped_sandbox_allows_everything_the_watchdog_does(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    keygen(keys / "id")
    keygen(keys / "host_key")
    engine = f"{PYTHON} {PROBE} engine"
    units = {
        "engine-root.service": f"[Service]\nType=exec\nExecStart={engine} --fifo /run/probe/fr_pipe_0\n",
        "engine-user.service": f"[Service]\nType=exec\nUser=nobody\nExecStart=/usr/bin/python3 {PROBE} engine --shm\n",
        "engine-container.service": "[Service]\nType=exec\nExecStart=/usr/bin/unshare --mount --pid --fork "
                                    f"--mount-proc --propagation private /usr/bin/python3 {PROBE} container\n",
        "target.service": "[Service]\nType=exec\nExecStart=/bin/sleep 3600\n",
        "dockerd-fake.service": f"[Service]\nType=exec\nExecStart={PYTHON} {PROBE} dockerd /run/docker.sock\n",
        "sshd.service": "[Service]\nType=exec\nExecStartPre=/bin/chmod 0600 /run/probe/host_key /run/probe/id\n"
                        "ExecStartPre=/bin/mkdir -p /run/sshd\n"
                        "ExecStart=/usr/sbin/sshd -D -e -f /run/probe/sshd_config\n",
        "probe.service": probe_unit(),
    }
    files = {
        PROBE: PROBE_SOURCE.read_text(),
        "/run/probe/id": (keys / "id").read_text(),
        "/run/probe/host_key": (keys / "host_key").read_text(),
        "/run/probe/authorized_keys": (keys / "id.pub").read_text(),
        "/run/probe/known_hosts": "[127.0.0.1]:2222 " + (keys / "host_key.pub").read_text(),
        "/run/probe/sshd_config": SSHD_CONFIG,
    }
    binds = {str(Path(sys.prefix) / "bin"): f"{ALIAS}/bin"} if HIDDEN else None
    ns = shipped_systemd("unit-sandbox", tmp_path / "systemd", "", units=units, files=files, binds=binds)
    ns.wanted.remove("probe.service")  # started by the test once the others are up
    with ns as sd:
        for unit in units:
            if unit != "probe.service":
                sd.wait_active(unit, timeout=60)
        sd.wait_active("engine-watchdog.service", timeout=60)  # the watchdog itself, beside the probe
        sd.systemctl("start", "probe.service", timeout=240)
        results = json.loads(sd.read_file(RESULTS))
        failed = {name: r["detail"] for name, r in results.items() if not r["ok"]}
        assert not failed, f"the sandbox refused: {json.dumps(failed, indent=1)}\n{sd.journal('probe.service')}"
        expected = {f"py-spy {u}" for u in ("engine-root.service", "engine-user.service", "engine-container.service")}
        expected |= {"py-spy --native engine-root.service", "py-spy --native engine-user.service",
                     "a container's files through /proc/PID/root", "another user's environ",
                     "signal another user's process", "systemctl restart", "docker restart", "journalctl",
                     "/dev/shm sweep of another user's segment", "the Flight Recorder pipe (on the read-only /run)",
                     "ptrace preflight", "ssh through a shared connection"}
        assert expected <= set(results), sorted(expected - set(results))
        assert results["ssh through a shared connection"]["detail"].strip() == "ssh-ok"
        docker_api = sd.read_file("/run/docker.sock.log").splitlines()
        assert any(line.startswith("POST /v") and line.endswith("/containers/vllm/restart?t=5")
                   for line in docker_api), docker_api
        # the probe ran as sandboxed as the watchdog beside it
        status = sd.read_file(f"/proc/{sd.main_pid('engine-watchdog.service')}/status")
        watchdog = {k: v.strip() for k, _, v in (line.partition(":\t") for line in status.splitlines())
                    if k in ("CapBnd", "CapEff", "NoNewPrivs", "Seccomp")}
        assert json.loads(results["own status"]["detail"]) == watchdog, (results["own status"], watchdog)
        assert watchdog["Seccomp"] == "2" and watchdog["NoNewPrivs"] == "1", watchdog
