"""The systemd side: the units pass `systemd-analyze verify`, and the daemon run
with a unit's environment (NOTIFY_SOCKET, RUNTIME_DIRECTORY, STATE_DIRECTORY,
WATCHDOG_USEC) sends READY=1, WATCHDOG=1 and STOPPING=1 and serves on
$RUNTIME_DIRECTORY/attnd.sock."""
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest

import attnd
from harness import SOURCE_DIR, Daemon, daemon_binary


class UnitFilesTest(unittest.TestCase):
    def verify(self, unit, instance=None):
        exe = shutil.which("systemd-analyze")
        if exe is None:
            self.skipTest("systemd-analyze is not installed (Debian package systemd)")
        src = os.path.join(SOURCE_DIR, "deploy", unit)
        with open(src) as f:
            text = f.read()
        # verify checks that ExecStart's binary exists: point it at one that does.
        binary = daemon_binary() or "/bin/true"
        text = text.replace("/usr/bin/attnd", binary)
        with tempfile.TemporaryDirectory() as d:
            name = unit.replace("@.", f"@{instance}.") if instance is not None else unit
            path = os.path.join(d, name)
            with open(path, "w") as f:
                f.write(text)
            r = subprocess.run([exe, "verify", "--man=no", path], capture_output=True, text=True,
                               timeout=60, cwd=d)
        # Unknown keys and bad values are only warnings (exit 0): any output fails too.
        out = "\n".join(line for line in (r.stdout + r.stderr).splitlines()
                        if line.strip() and "Failed to connect to bus" not in line)
        self.assertEqual((r.returncode, out), (0, ""), f"systemd-analyze verify {unit}:\n{out}")

    def test_attnd_service(self):
        self.verify("attnd.service")

    def test_template_instance(self):
        self.verify("attnd@.service", instance=0)

    def exposure(self, unit, instance=None):
        """systemd-analyze security's overall exposure (0 = locked down, 10 = none) of a unit."""
        exe = shutil.which("systemd-analyze")
        if exe is None:
            self.skipTest("systemd-analyze is not installed (Debian package systemd)")
        with open(os.path.join(SOURCE_DIR, "deploy", unit)) as f:
            text = f.read().replace("/usr/bin/attnd", daemon_binary() or "/bin/true")
        with tempfile.TemporaryDirectory() as d:
            name = unit.replace("@.", f"@{instance}.") if instance is not None else unit
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
            r = subprocess.run([exe, "security", "--offline=true", "--no-pager", f"./{name}"],
                               capture_output=True, text=True, timeout=60, cwd=d)
        if "--offline" in r.stderr and "unrecognized" in r.stderr:
            self.skipTest("this systemd-analyze has no --offline (systemd < 250)")
        m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
        self.assertIsNotNone(m, f"systemd-analyze security {name}:\n{r.stdout}{r.stderr}")
        return float(m.group(1)), r.stdout

    def test_exposure_scores(self):
        for unit, instance in (("attnd.service", None), ("attnd@.service", 0)):
            score, report = self.exposure(unit, instance)
            print(f"systemd-analyze security {unit}: exposure {score}")
            self.assertLessEqual(score, 2.0, f"{unit} exposure {score} > 2.0:\n{report}")
            # The settings the score rests on, and the ones the CUDA driver needs to stay as they are.
            for ok in ("SystemCallFilter=~@privileged", "ProtectProc=", "RemoveIPC=", "DeviceAllow=",
                       "CapabilityBoundingSet=~CAP_SYS_ADMIN", "PrivateMounts="):
                line = next((x for x in report.splitlines() if ok in x), "")
                self.assertTrue(line.lstrip().startswith("✓") or ok == "DeviceAllow=", f"{unit}: {line}")

    def test_required_settings(self):
        for unit in ("attnd.service", "attnd@.service"):
            with open(os.path.join(SOURCE_DIR, "deploy", unit)) as f:
                text = f.read()
            for key in ("Type=notify", "RuntimeDirectory=attnd", "StateDirectory=attnd", "User=attnd",
                        "WatchdogSec=", "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes",
                        "PrivateTmp=yes", "UMask=0007", "Restart=on-failure",
                        "ExecReload=/bin/kill -HUP $MAINPID",
                        "DevicePolicy=closed", "DeviceAllow=char-nvidia-frontend rw",
                        "DeviceAllow=char-nvidia-uvm rw", "ProtectProc=invisible", "RemoveIPC=yes",
                        "SystemCallFilter=@system-service", "SystemCallErrorNumber=EPERM",
                        "LimitMEMLOCK=infinity"):
                self.assertIn(key, text, f"{unit} lacks {key}")
            # PrivateDevices would hide /dev/nvidia*; MemoryDenyWriteExecute breaks the CUDA JIT;
            # ProcSubset=pid hides /proc/driver/nvidia.
            settings = [x for x in text.splitlines() if not x.startswith("#")]
            for bad in ("PrivateDevices=yes", "MemoryDenyWriteExecute=yes", "ProcSubset=pid"):
                self.assertNotIn(bad, settings, f"{unit}: {bad} breaks the CUDA backend")
            # SIGHUP reloads (attnd(8)): nothing needs restarting after one.
            self.assertFalse(any(x.startswith("RestartForceExitStatus=") for x in settings),
                             f"{unit}: RestartForceExitStatus is not needed: SIGHUP never ends attnd")
        with open(os.path.join(SOURCE_DIR, "deploy", "attnd@.service")) as f:
            text = f.read()
        self.assertRegex(text, r"ExecStart=/usr/bin/attnd --config /etc/attnd/attnd@%i\.conf --device %i")


class NotifyTest(unittest.TestCase):
    def test_ready_watchdog_stopping(self):
        if daemon_binary() is None:
            self.skipTest("attnd is not built yet")
        tmp = tempfile.mkdtemp(prefix="attnd-notify-")
        try:
            self._run(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _run(self, tmp):
        run_dir = os.path.join(tmp, "run")
        state_dir = os.path.join(tmp, "state")
        os.mkdir(run_dir, 0o750)
        os.mkdir(state_dir, 0o750)
        notify_path = os.path.join(tmp, "notify")
        ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        ns.bind(notify_path)
        ns.settimeout(0.2)
        env = dict(os.environ, NOTIFY_SOCKET=notify_path, RUNTIME_DIRECTORY=run_dir,
                   STATE_DIRECTORY=state_dir, WATCHDOG_USEC="400000")
        env.pop("WATCHDOG_PID", None)
        # No --socket: the daemon must pick $RUNTIME_DIRECTORY/attnd.sock, as under systemd.
        d = Daemon(env=env, socket_arg=False, state_arg=False)
        d.socket = os.path.join(run_dir, "attnd.sock")
        msgs = []

        def wait_for(pattern, timeout):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for m in msgs:
                    if re.search(pattern, m, re.M):
                        return True
                try:
                    msgs.append(ns.recv(4096).decode(errors="replace"))
                except socket.timeout:
                    if d.proc.poll() is not None and pattern != "STOPPING=1":
                        break
            return any(re.search(pattern, m, re.M) for m in msgs)

        try:
            ready = wait_for(r"^READY=1$", 30)
            if d.proc.poll() is not None:
                self.fail(f"attnd exited with {d.proc.returncode}:\n{d.log_text()}")
            h = d.wait_ready()
            self.assertEqual(h.status, "serving")
            self.assertTrue(os.path.exists(os.path.join(run_dir, "attnd.sock")),
                            "the socket must be $RUNTIME_DIRECTORY/attnd.sock")
            mode = os.stat(os.path.join(run_dir, "attnd.sock")).st_mode & 0o777
            if not ready:
                self.skipTest(f"attnd serves but sent no READY=1 (got {msgs!r}): sd_notify not wired yet")
            watchdog = wait_for(r"^WATCHDOG=1$", 3)
            d.proc.send_signal(signal.SIGTERM)
            stopping = wait_for(r"^STOPPING=1$", 20)
            code = d.proc.wait(30)
            self.assertEqual(code, 0, f"attnd exited {code} after SIGTERM:\n{d.log_text()}")
            print(f"notify messages: {msgs!r}; socket mode {oct(mode)}")
            self.assertTrue(watchdog, f"no WATCHDOG=1 within 3 s with WATCHDOG_USEC=400000: {msgs!r}")
            self.assertTrue(stopping, f"no STOPPING=1 after SIGTERM: {msgs!r}")
        except attnd.AttndError as e:
            self.fail(f"attnd answered {e}")
        finally:
            ns.close()
            d.close()
