"""SIGINT / SIGTERM / the launcher's exit as a stop (plugin.job.interrupt), in small child processes: quiet during
start-up, a request at the step boundary once training, the grace period, a second SIGINT, the launcher watch."""
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import os, sys, time
sys.path.insert(0, {root!r})
from plugin.job.interrupt import Interrupts
grace, phase, launched = float(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
stop = Interrupts(grace_s=grace, echo_s=0.3, launched=launched, say=lambda line: print(line, flush=True)).install()
stop.on_exit.append(lambda: print("released", flush=True))
if phase != "start-up":
    stop.training()
print("ready", flush=True)
step = 0
while True:  # a training loop whose steps take 0.1 s; "hang": once asked to stop, a step that never ends
    time.sleep(0.1)
    while phase == "hang" and stop.is_requested():
        time.sleep(100)
    step += 1
    if stop.is_requested():
        print(f"stopped after step {{step}} ({{stop.requested}})", flush=True)
        stop.done()
        time.sleep(0.5)  # the save: the grace timer no longer applies
        sys.exit(stop.exit_code())
'''
ROOT = str(Path(__file__).resolve().parents[3])


def _start(tmp_path, grace=30.0, phase="training", launched=False):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=ROOT))
    proc = subprocess.Popen([sys.executable, str(script), str(grace), "start-up" if phase == "start-up" else
                             "training" if phase == "training" else "hang", "1" if launched else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def _end(proc, timeout=20):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_start_up_ends_quietly_at_once(tmp_path):
    proc = _start(tmp_path, phase="start-up")
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, out, err = _end(proc)
    assert code == 130 and time.monotonic() - start < 5
    assert out == "" and err == ""  # a quiet SystemExit: no traceback, no KeyboardInterrupt


def test_training_stops_at_the_step_boundary_with_the_signal_s_status(tmp_path):
    for signum, launched, status in ((signal.SIGTERM, False, 143), (signal.SIGINT, True, 0)):
        proc = _start(tmp_path, launched=launched)
        time.sleep(0.25)
        proc.send_signal(signum)
        code, out, err = _end(proc)
        assert code == status and err == "", (code, err)
        assert out.startswith("stopped after step ") and f"({signal.Signals(signum).name})" in out


def test_a_second_sigint_ends_at_once_an_echo_does_not(tmp_path):
    proc = _start(tmp_path, phase="hang")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # within echo_s: the same Ctrl-C passed on by a launcher
    time.sleep(0.6)
    assert proc.poll() is None
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, out, err = _end(proc)
    assert code == 130 and time.monotonic() - start < 5 and "Traceback" not in err
    assert out == "released\nsecond interrupt: stopped at once, without saving\n"


def test_the_grace_period_ends_a_step_that_never_ends(tmp_path):
    proc = _start(tmp_path, grace=1.0, phase="hang")
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, out, err = _end(proc)
    assert code == 143 and 0.9 < time.monotonic() - start < 10 and "Traceback" not in err
    assert out == ("released\nstopped 1 s after SIGTERM (the grace period) before the step's checkpoint was "
                   "complete: stopped without it\n")


def test_the_launcher_s_exit_is_a_stop(tmp_path):
    """A launcher (a Python parent) killed outright: its worker stops at its next step boundary instead of
    training on as an orphan."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=ROOT))
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])",
                                 sys.executable, str(script), "30", "training", "1"],
                                stdout=subprocess.PIPE, text=True)
    assert launcher.stdout.readline() == "ready\n"
    worker = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                  and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(launcher.pid))
    launcher.kill()
    line = launcher.stdout.readline()
    assert line.startswith("stopped after step ") and f"(the launcher (pid {launcher.pid}) exited)" in line
    launcher.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]
