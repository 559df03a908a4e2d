"""weightcache supervise: a real supervisor process forking real engines.

Each test runs ``python -m weightcache supervise ... -- python ENGINE`` with an engine
script written for the test, and reads what the engine wrote, the supervisor's log
(stderr) and its --status file.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from weightcache.engine import RESTART_EXIT_CODE, read_record, recordable_modules, write_record
from weightcache.errors import ConfigError
from weightcache.supervise.command import parse_command
from weightcache.supervise.loop import Supervisor, SupervisorOptions
from weightcache.supervise.policy import EngineExit, RestartPolicy
from weightcache.systemd import StopRequests

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def supervise(args: list[str], engine: list[str], cwd: Path, **kw) -> subprocess.Popen[str]:
    env = kw.pop("env", None) or {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(cwd)])}
    return subprocess.Popen([PY, "-m", "weightcache", "supervise", *args, "--", PY, *engine], cwd=cwd, env=env,
                            stdout=kw.pop("stdout", subprocess.PIPE), stderr=kw.pop("stderr", subprocess.PIPE), text=True, **kw)


def wait_for(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- the pure parts ---------------------------------------------------------------------


def ex(status: int, uptime: float = 0.1) -> EngineExit:
    return EngineExit(pid=1, status=status, uptime_s=uptime, ready_s=None, reason=None)


def test_policy_restarts_at_once_then_backs_off_and_resets():
    p = RestartPolicy(backoff_max_s=4, stable_after_s=10)
    assert [p.decide(ex(1)) for _ in range(5)] == [0, 1, 2, 4, 4]
    assert p.crashes == 5 and p.crash_streak == 5
    assert p.decide(ex(-signal.SIGKILL, uptime=11)) == 0  # ran long enough: a new streak
    assert p.crash_streak == 1
    assert p.decide(ex(1)) == 1
    assert p.decide(ex(RESTART_EXIT_CODE)) == 0 and p.crash_streak == 0 and p.planned == 1
    assert p.decide(ex(1)) == 0  # a planned restart ended the streak
    assert p.decide(ex(0)) is None  # finished: stop


def test_policy_backs_off_planned_restarts_that_come_in_a_loop():
    # An engine that asks for a restart at every start was forked ~190 times a second
    # forever (measured on the dev VM): only the first few quick ones in a row are at once.
    p = RestartPolicy(backoff_max_s=4, stable_after_s=10)
    burst = RestartPolicy.PLANNED_BURST
    assert [p.decide(ex(RESTART_EXIT_CODE)) for _ in range(burst + 4)] == [0] * burst + [1, 2, 4, 4]
    assert p.crash_streak == 0 and p.planned == burst + 4
    assert p.decide(ex(1)) == 0 and p.decide(ex(RESTART_EXIT_CODE)) == 4  # a crash between ends no loop
    assert p.decide(ex(RESTART_EXIT_CODE, uptime=11)) == 0  # an engine that ran stable_after_s: at once again
    assert [p.decide(ex(RESTART_EXIT_CODE)) for _ in range(burst + 1)] == [0] * burst + [1]
    assert p.decide(ex(1, uptime=11)) == 0 and p.decide(ex(RESTART_EXIT_CODE)) == 0  # so does a long crash


def test_the_status_file_is_not_written_through_a_planted_link(tmp_path):
    # The status file was written to a fixed name beside it (".st.json.tmp"), opened
    # following links: whoever may write the directory made the supervisor (often root)
    # overwrite any file, then move their own file into place as the status.
    victim = write(tmp_path / "victim", "keep")
    (tmp_path / ".st.json.tmp").symlink_to(victim)
    sup = Supervisor(parse_command([PY, str(write(tmp_path / "e.py", ""))]), SupervisorOptions(status=str(tmp_path / "st.json")))
    sup._publish()
    assert victim.read_text() == "keep"
    assert json.loads((tmp_path / "st.json").read_text())["state"] == "starting"
    assert not (tmp_path / "st.json").is_symlink() and (tmp_path / "st.json").stat().st_mode & 0o044 == 0o044 & ~_umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".st.json.tmp", "e.py", "st.json", "victim"]  # no temporary left


def test_the_record_is_not_written_through_a_planted_link(tmp_path, monkeypatch):
    # The record's temporary had the engine's pid in its name: guessable, and opened
    # following links, so it could be planted as a link (any file overwritten) or as a
    # file of the planter's own, moved into place as the list of modules to preload.
    victim = write(tmp_path / "victim", "keep")
    for pid in (os.getpid(), 4242):
        (tmp_path / f".rec.txt.{pid}.tmp").symlink_to(victim)
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    write_record(tmp_path / "rec.txt", ["json"])
    assert victim.read_text() == "keep" and read_record(tmp_path / "rec.txt") == ["json"]
    assert not (tmp_path / "rec.txt").is_symlink()
    assert len(list(tmp_path.iterdir())) == 4  # victim, two links, the record: no temporary left


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_parse_command(tmp_path):
    script = write(tmp_path / "e.py", "")
    cmd = parse_command(["--", PY, str(script), "a", "--b"])
    assert cmd.argv == (str(script), "a", "--b") and cmd.script == str(script) and cmd.path0 == str(tmp_path)
    mod = parse_command([PY, "-m", "json.tool", "x"])
    assert mod.module == "json.tool" and mod.argv == ("-m", "x") and mod.path0 == os.getcwd()
    for bad, says in (([], "no engine"), ([PY], "no engine"), ([PY, "-u", str(script)], "PYTHONUNBUFFERED"),
                      ([PY, str(tmp_path / "missing.py")], "can't open file"), (["/bin/sh", str(script)], "start the supervisor with"),
                      ([PY, "-m"], "-m needs")):
        with pytest.raises(ConfigError, match=says):
            parse_command(bad)


def test_recordable_modules_leave_out_the_engines_own_code(tmp_path):
    own = tmp_path / "mine.py"
    mine = type(sys)("mine")
    mine.__file__, mine.__spec__ = str(own), json.__spec__
    mods = {"mine": mine, "json": json, "__main__": json, "already": json, "made_up": type(sys)("made_up")}
    got = recordable_modules(["json", "mine", "__main__", "already", "made_up"], mods, frozenset({"already"}), str(tmp_path))
    assert got == ["json"]


# -- restarts ---------------------------------------------------------------------------

COUNTING = """
    import os, sys, time
    from weightcache import engine
    here = os.path.dirname(os.path.abspath(__file__))
    starts = open(os.path.join(here, "starts"), "a+")
    starts.write(f"{os.getpid()} {time.monotonic()}\\n"); starts.flush()
    n = sum(1 for _ in open(os.path.join(here, "starts"))) - 1
    engine.ready()
    PLAN = PLAN_HERE
    what = PLAN[n] if n < len(PLAN) else "exit0"
    if what == "crash": sys.exit(3)
    if what == "raise": raise RuntimeError("engine bug")
    if what == "kill": os.kill(os.getpid(), signal.SIGKILL)
    if what == "restart": engine.restart("switch to model B")
    sys.exit(0)
"""


def counting_engine(tmp_path: Path, plan: list[str]) -> Path:
    return write(tmp_path / "engine.py", "import signal\n" + textwrap.dedent(COUNTING).replace("PLAN_HERE", repr(plan)))


def test_restart_after_crash_then_backoff(tmp_path):
    engine = counting_engine(tmp_path, ["crash", "raise", "restart", "kill"])
    p = supervise(["--status", "st.json"], [str(engine)], tmp_path)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    starts = [float(line.split()[1]) for line in (tmp_path / "starts").read_text().splitlines()]
    assert len(starts) == 5
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps[0] < 0.9  # the first crash restarts at once
    assert gaps[1] >= 1.0  # the second crash in a row waits 1 s
    assert gaps[2] < 0.9  # a planned restart never waits
    assert gaps[3] < 0.9  # ... and ended the streak: the next crash is a first again
    st = json.loads((tmp_path / "st.json").read_text())
    assert [e["status"] for e in st["exits"]] == [3, 1, RESTART_EXIT_CODE, -signal.SIGKILL, 0]
    assert [e["kind"] for e in st["exits"]] == ["crash", "crash", "planned", "crash", "finished"]
    assert st["exits"][2]["reason"] == "switch to model B"
    assert all(e["ready_s"] is not None for e in st["exits"])
    assert (st["forks"], st["restarts"], st["planned_restarts"], st["crashes"], st["state"]) == (5, 4, 1, 3, "finished")
    assert "exited with status 3" in err and "crash 2 in a row); restart 2 in 1 s" in err
    assert "asking for a restart: switch to model B (planned restart); restart 3 now" in err
    assert "was killed by SIGKILL" in err and "RuntimeError: engine bug" in err  # the engine's traceback, on its stderr


# -- signals and stopping ---------------------------------------------------------------

SIGNALLED = """
    import os, signal, sys, time
    from weightcache import engine
    log = open("signals", "a", buffering=1)
    def on(sig, frame):
        log.write(f"{{signal.Signals(sig).name}}\\n")
        if sig == signal.SIGTERM:
            time.sleep({term_delay})  # a clean shutdown takes a while
            log.write("engine done\\n")
            sys.exit(0)
    for s in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH):
        signal.signal(s, on)
    signal.signal(signal.SIGTERM, on if {handle_term} else signal.SIG_IGN)
    log.write(f"ready {{os.getpid()}}\\n")
    engine.ready()
    while True:
        time.sleep(0.05)
"""


def signalled_engine(tmp_path: Path, term_delay: float = 0.5, handle_term: bool = True) -> Path:
    return write(tmp_path / "engine.py", textwrap.dedent(SIGNALLED).format(term_delay=term_delay, handle_term=handle_term))


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def engine_pid(tmp_path: Path) -> int:
    wait_for(lambda: any(x.startswith("ready") for x in lines(tmp_path / "signals")))
    return int(next(x for x in lines(tmp_path / "signals") if x.startswith("ready")).split()[1])


def test_signals_pass_through_and_sigterm_stops_in_order(tmp_path):
    p = supervise(["--status", "st.json"], [str(signalled_engine(tmp_path))], tmp_path)
    pid = engine_pid(tmp_path)
    for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH):
        p.send_signal(sig)
        wait_for(lambda sig=sig: sig.name in lines(tmp_path / "signals"))
    assert p.poll() is None and alive(pid)  # passed on, and nobody stopped
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert lines(tmp_path / "signals")[-2:] == ["SIGTERM", "engine done"]  # the engine finished its shutdown ...
    assert not alive(pid)  # ... before the supervisor exited
    assert "SIGTERM: stopping the engine" in err and "exited with status 0" in err and "stopped" in err
    assert json.loads((tmp_path / "st.json").read_text())["forks"] == 1  # not restarted


def test_stop_timeout_kills_an_engine_that_ignores_sigterm(tmp_path):
    p = supervise(["--stop-timeout", "1"], [str(signalled_engine(tmp_path, handle_term=False))], tmp_path)
    pid = engine_pid(tmp_path)
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1, err
    assert 0.9 < time.monotonic() - t < 10
    assert not alive(pid) and "SIGKILL" in err


def test_second_stop_signal_kills_at_once(tmp_path):
    p = supervise(["--stop-timeout", "60"], [str(signalled_engine(tmp_path, term_delay=60))], tmp_path)
    pid = engine_pid(tmp_path)
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM" in lines(tmp_path / "signals"))
    p.send_signal(signal.SIGINT)  # another signal, however soon: the operator asking again
    _, err = p.communicate(timeout=20)
    assert p.returncode == 1 and not alive(pid) and "second SIGINT" in err


def test_a_stop_signal_sent_to_the_process_and_its_group_stops_gracefully(tmp_path):
    """`timeout` sends the signal to the supervisor and then to its whole group:
    the same request, twice within milliseconds, is not the operator asking for a kill."""
    p = supervise(["--stop-timeout", "60"], [str(signalled_engine(tmp_path, term_delay=2.0))], tmp_path)
    pid = engine_pid(tmp_path)
    sent_at = time.monotonic()
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM" in lines(tmp_path / "signals"))  # taken and passed on: not merged with the next
    p.send_signal(signal.SIGTERM)
    if time.monotonic() - sent_at >= StopRequests.REPEAT_AFTER_S:
        p.kill()
        p.communicate()
        pytest.skip("the supervisor took a second or more to pass the first SIGTERM on, on this machine")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert lines(tmp_path / "signals")[-1] == "engine done" and not alive(pid)
    assert "second SIGTERM" not in err and "SIGKILL" not in err and "taken as the same request" in err, err


def test_stop_during_backoff_exits_without_a_new_engine(tmp_path):
    engine = counting_engine(tmp_path, ["crash"] * 10)
    p = supervise(["--backoff-max", "60", "--status", "st.json"], [str(engine)], tmp_path)
    wait_for(lambda: len(lines(tmp_path / "starts")) >= 3)  # the third start is followed by a 2 s wait
    wait_for(lambda: json.loads((tmp_path / "st.json").read_text())["state"] == "backoff")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    assert len(lines(tmp_path / "starts")) == 3
    st = json.loads((tmp_path / "st.json").read_text())  # what a monitor reads after the exit
    assert st["state"] == "stopped" and st["next_start_in_s"] is None and st["engine"] is None, st


def test_orphans_of_the_engine_are_reaped(tmp_path):
    # The engine leaves a child behind (as a worker pool might); it becomes the supervisor's
    # (PR_SET_CHILD_SUBREAPER, as with PID 1 in a container) and is reaped, not left a zombie.
    write(tmp_path / "engine.py", """
        import os, sys, time
        from weightcache import engine
        if not os.path.exists("orphan"):
            pid = os.fork()
            if pid == 0:
                time.sleep(0.5)
                os._exit(0)
            open("orphan", "w").write(str(pid))
            engine.restart("leave the child behind")
        time.sleep(3)
    """)
    p = supervise([], [str(tmp_path / "engine.py")], tmp_path)
    wait_for(lambda: (tmp_path / "orphan").exists() and (tmp_path / "orphan").read_text() != "")
    orphan = int((tmp_path / "orphan").read_text())
    wait_for(lambda: not os.path.exists(f"/proc/{orphan}"), timeout=10)  # reaped while the second engine runs
    assert p.poll() is None
    _, err = p.communicate(timeout=20)
    assert p.returncode == 0, err


# -- fork safety --------------------------------------------------------------------------


def refused(tmp_path: Path, template_module: str, *more: str) -> str:
    write(tmp_path / "tmpl.py", template_module)
    write(tmp_path / "engine.py", "open('started', 'w')\n")
    p = supervise(["--preload", ",".join(["tmpl", *more])], [str(tmp_path / "engine.py")], tmp_path)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2, err
    assert not (tmp_path / "started").exists()  # no engine was forked
    return err


def started(tmp_path: Path, template_module: str) -> None:
    """The template imports; the supervisor forks the engine."""
    write(tmp_path / "tmpl.py", template_module)
    write(tmp_path / "engine.py", "open('started', 'w')\n")
    p = supervise(["--preload", "tmpl"], [str(tmp_path / "engine.py")], tmp_path)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert (tmp_path / "started").exists()


def test_refuses_when_the_cuda_driver_was_initialised(tmp_path):
    # cuInit opens /dev/nvidiactl; without a GPU the template module points the check at a
    # file of its own and opens it, as the driver would its device file.
    err = refused(tmp_path, """
        import os
        import weightcache.supervise.fork_safety as fs
        fs.DRIVER_DEVICES = (os.path.join(os.path.dirname(__file__), "nvidiactl"),)
        DRIVER = open(fs.DRIVER_DEVICES[0], "w")
    """)
    assert "nvidiactl is open" in err and "does not survive fork" in err and "Importing tmpl initialised it" in err


def test_a_driver_library_loaded_but_not_initialised_is_no_reason_to_refuse(tmp_path):
    # torch 2.11 (cu130) maps libcuda.so when imported, without cuInit: forking is safe.
    path = tmp_path / "libcuda.so.1"
    path.write_bytes(b"\0" * 4096)
    started(tmp_path, f"""
import mmap
with open({str(path)!r}, "rb") as f:
    DRIVER = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)
""")


def test_refuses_when_torch_says_cuda_is_initialised(tmp_path):
    # torch.cuda.is_initialized() cannot become true without a GPU; the template module
    # makes torch answer as it would after CUDA init, to show the supervisor asks.
    err = refused(tmp_path, "import torch\ntorch.cuda.is_initialized = lambda: True\n")
    assert "torch.cuda.is_initialized()" in err


def test_refuses_when_a_thread_runs_and_names_the_module(tmp_path):
    err = refused(tmp_path, """
        import threading, time
        threading.Thread(target=time.sleep, args=(60,), name="metrics-pusher", daemon=True).start()
    """)
    assert "'metrics-pusher' (Python)" in err and "tmpl (+1)" in err


def test_refuses_when_a_native_thread_runs(tmp_path):
    # torch's intra-op pool: started by the first parallel op, not by the import.
    err = refused(tmp_path, "import torch\ntorch.set_num_threads(2)\ntorch.ones(512, 512) @ torch.ones(512, 512)\n")
    assert "(native)" in err


NATIVE_THREAD = """
    import _thread, ctypes, glob, time
    def run(name):
        # PR_SET_NAME (15) names the thread in /proc/self/task/TID/comm, as a C library does;
        # a _thread thread is not in threading.enumerate(): native, as far as the check sees.
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)
        time.sleep(60)
    for name in NAMES:
        _thread.start_new_thread(run, (name,))
    def comms():
        out = set()
        for p in glob.glob("/proc/self/task/*/comm"):
            try:
                with open(p, "rb") as f:
                    out.add(f.read().strip())
            except OSError:  # a thread that ended meanwhile
                pass
        return out
    # Every thread named before the check runs (a fixed sleep could end first on a loaded machine).
    deadline = time.monotonic() + 30
    while not set(NAMES) <= comms():
        if time.monotonic() > deadline:
            raise RuntimeError(f"threads {NAMES} not named within 30 s: {comms()}")
        time.sleep(0.01)
"""


def test_a_jemalloc_background_thread_is_left_running(tmp_path):
    # jemalloc's own fork handlers stop its background threads in the child (Note [fork safety]).
    started(tmp_path, "NAMES = [b'jemalloc_bg_thd']\n" + textwrap.dedent(NATIVE_THREAD))


def test_any_other_native_thread_beside_it_is_refused(tmp_path):
    err = refused(tmp_path, "NAMES = [b'jemalloc_bg_thd', b'grpc_poller']\n" + textwrap.dedent(NATIVE_THREAD))
    assert "'grpc_poller' (native)" in err and "jemalloc" not in err and "1 other thread(s)" in err


# An OpenBLAS-style pool, made on purpose so the test depends on neither the machine's core
# count nor its BLAS build: a thread starts when the library loads, and
# blas_thread_shutdown_ asks it to stop and returns before it has gone (LINGER_US later),
# the window a loaded host opens between OpenBLAS's join and the thread leaving
# /proc/self/task (Note [fork safety]). STOPS 0: a pool that ignores the request.
FAKE_POOL = r"""
#include <pthread.h>
#include <sys/prctl.h>
#include <unistd.h>
static volatile int stop;
static void *run(void *arg) {
    prctl(PR_SET_NAME, "python3");  /* named as OpenBLAS's threads are: after the process */
    while (!stop || !STOPS) usleep(1000);
    usleep(LINGER_US);
    return arg;
}
__attribute__((constructor)) static void start(void) { pthread_t t; pthread_create(&t, 0, run, 0); }
void blas_thread_shutdown_(void) { stop = 1; }
"""


def fake_pool(tmp_path: Path, linger_us: int, stops: bool = True) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the fake OpenBLAS pool")
    src = tmp_path / "fake_pool.c"
    src.write_text(FAKE_POOL)
    lib = tmp_path / "libfakeopenblas.so"  # quiesce_openblas finds OpenBLAS by its file name
    subprocess.run([cc, "-shared", "-fPIC", "-O1", f"-DLINGER_US={linger_us}", f"-DSTOPS={int(stops)}", "-o", str(lib), str(src),
                    "-lpthread"], check=True)
    return lib


LOAD_POOL = """
    import ctypes, os
    POOL = ctypes.CDLL({lib!r})
    assert len(os.listdir("/proc/self/task")) == 2  # the precondition: the pool's thread runs
"""


def test_a_pool_asked_to_stop_is_waited_for_and_the_engine_starts(tmp_path):
    # Without the wait the check ran while the thread was still leaving: refused every time.
    lib = fake_pool(tmp_path, linger_us=300_000)
    started(tmp_path, LOAD_POOL.format(lib=str(lib)))


def test_a_pool_that_does_not_stop_is_refused(tmp_path):
    # Refused after POOL_STOP_WAIT_S: asked to stop, its thread is still there.
    lib = fake_pool(tmp_path, linger_us=0, stops=False)
    err = refused(tmp_path, LOAD_POOL.format(lib=str(lib)))
    assert "1 other thread(s) running in the template" in err and "'python3' (native)" in err and "tmpl (+1)" in err


def test_refuses_a_socket_opened_by_the_template(tmp_path):
    err = refused(tmp_path, "import socket\nCONN = socket.socketpair()\n")
    assert "socket(s) open" in err and "Importing tmpl opened one" in err


def test_an_unknown_preload_is_an_error(tmp_path):
    err = refused(tmp_path, "", "no_such_module_xyz")
    assert "--preload no_such_module_xyz: cannot import it" in err


def test_numpy_openblas_pool_is_stopped_not_refused_and_random_state_differs(tmp_path):
    # numpy's OpenBLAS starts its thread pool at load: the supervisor stops it as OpenBLAS's
    # own fork handler would, the engine's BLAS works, and engines draw different numbers.
    write(tmp_path / "engine.py", """
        import json, os, random, numpy, torch
        from weightcache import engine
        a = numpy.ones((300, 300))
        draws = {"random": random.random(), "numpy": float(numpy.random.random()), "torch": float(torch.rand(1)),
                 "blas_ok": float((a @ a)[0, 0]) == 300.0}
        with open("draws", "a") as f:
            f.write(json.dumps(draws) + "\\n")
        if sum(1 for _ in open("draws")) < 2:
            engine.restart("again")
    """)
    p = supervise(["--preload", "numpy,torch"], [str(tmp_path / "engine.py")], tmp_path)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    a, b = (json.loads(x) for x in lines(tmp_path / "draws"))
    assert a["blas_ok"] and b["blas_ok"]
    assert a["random"] != b["random"] and a["numpy"] != b["numpy"] and a["torch"] != b["torch"]


# -- the engine sees what it would have seen ------------------------------------------------

PROBE = """
    import json, logging, os, signal, sys, threading
    import weightcache.engine as wce
    early = sorted(m for m in ("numpy", "json") if m in sys.modules)
    def target(fd):
        try:
            st = os.fstat(fd)
            return [st.st_dev, st.st_ino]
        except OSError:
            return None
    link_fd = wce._link.fd if wce._link else None
    fds = sorted(int(x) for x in os.listdir("/proc/self/fd") if int(x) > 2 and int(x) != link_fd)
    fds = [fd for fd in fds if target(fd) is not None]
    report = {
        "argv": sys.argv, "orig_argv": sys.orig_argv, "cwd": os.getcwd(), "env": dict(os.environ), "path0": sys.path[0],
        "name": __name__, "file": __file__, "spec": __spec__.name if __spec__ else None,
        "loader": type(__loader__).__name__, "package": __package__,
        "stdio": [target(0), target(1), target(2)], "stdin": sys.stdin.read(), "other_fds": len(fds),
        "handlers": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGHUP,
                                                                 signal.SIGCHLD, signal.SIGUSR1)},
        "blocked": sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "root_handlers": len(logging.getLogger().handlers), "threads": threading.active_count(),
        "main_thread": threading.current_thread() is threading.main_thread(),
        "annotations_future": "annotations" in globals(), "supervised": wce.supervised(),
    }
    print("stdout line")
    print("stderr line", file=sys.stderr)
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump(report, f)
"""


@pytest.mark.parametrize("as_module", [False, True])
def test_engine_sees_what_it_would_have_unsupervised(tmp_path, as_module):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    write(work / "probe.py", PROBE)
    engine = ["-m", "probe"] if as_module else ["probe.py"]
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "ODD": "x y\tz", "LANG": "C.UTF-8"}
    reports = {}
    for how in ("fresh", "supervised"):
        out, err = tmp_path / f"{how}.out", tmp_path / f"{how}.err"
        e = {**env, "PROBE_OUT": str(tmp_path / f"{how}.json")}
        with open(out, "w") as o, open(err, "w") as r:
            if how == "fresh":
                p = subprocess.Popen([PY, *engine, "a", "--flag", "b c"], cwd=work, env=e, stdin=subprocess.PIPE, stdout=o, stderr=r,
                                     text=True)
            else:
                p = supervise(["--preload", "json"], [*engine, "a", "--flag", "b c"], work, env=e, stdin=subprocess.PIPE, stdout=o,
                              stderr=r)
            p.communicate("stdin text", timeout=60)
        assert p.returncode == 0, err.read_text()
        rep = json.loads((tmp_path / f"{how}.json").read_text())
        files = [[os.stat(f).st_dev, os.stat(f).st_ino] for f in (out, err)]
        assert rep["stdio"][1:] == files  # its stdout and stderr are the files the caller gave
        assert out.read_text() == "stdout line\n" and "stderr line\n" in err.read_text()
        rep["stdio"][1:] = ["stdout", "stderr"]
        rep["stdio"][0] = rep["stdio"][0] is not None
        assert rep["env"].pop("PROBE_OUT") == e["PROBE_OUT"]  # the one variable the two runs differ in
        reports[how] = rep
    fresh, sup = reports["fresh"], reports["supervised"]
    assert (fresh.pop("supervised"), sup.pop("supervised")) == (False, True)
    assert sup == fresh
    assert fresh["stdin"] == "stdin text" and fresh["env"]["ODD"] == "x y\tz" and fresh["cwd"] == str(work)


# -- recording the engine's imports -----------------------------------------------------------


def test_record_then_preload_at_the_next_start(tmp_path):
    write(tmp_path / "helper.py", "X = 1\n")  # the engine's own code: never recorded
    write(tmp_path / "engine.py", """
        import sys
        print("numpy at start:", "numpy" in sys.modules, flush=True)
        import numpy, helper
        from weightcache import engine
        engine.ready()
    """)
    rec = tmp_path / "modules.txt"
    first = supervise(["--record", str(rec)], [str(tmp_path / "engine.py")], tmp_path)
    out1, err1 = first.communicate(timeout=60)
    assert first.returncode == 0, err1
    names = read_record(rec)
    assert "numpy" in names and "numpy.linalg" in names and "helper" not in names and "__main__" not in names
    assert "weightcache.engine" not in names  # the supervisor imports it anyway
    assert "numpy at start: False" in out1
    second = supervise(["--record", str(rec)], [str(tmp_path / "engine.py")], tmp_path)
    out2, err2 = second.communicate(timeout=60)
    assert second.returncode == 0, err2
    assert "numpy at start: True" in out2
    assert f"from {rec}" in err2 and "preloaded" in err2
    assert f"{rec} unchanged (the engine imported nothing new)" in err2  # not rewritten on every restart


def test_a_recorded_module_that_starts_a_thread_is_refused_then_excluded(tmp_path):
    write(tmp_path / "pusher.py", "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    rec = write(tmp_path / "modules.txt", "json\npusher\n")
    write(tmp_path / "engine.py", "import sys\nprint('pusher' in sys.modules)\n")
    p = supervise(["--record", str(rec)], [str(tmp_path / "engine.py")], tmp_path)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "pusher (+1)" in err and "--exclude MODULE" in err
    p = supervise(["--record", str(rec), "--exclude", "pusher"], [str(tmp_path / "engine.py")], tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out == "False\n"  # the engine imports it itself, after the fork


def test_a_stale_record_entry_is_skipped_not_fatal(tmp_path):
    rec = write(tmp_path / "modules.txt", "# comment\njson\nno_such_module_xyz\n")
    write(tmp_path / "engine.py", "")
    p = supervise(["--record", str(rec)], [str(tmp_path / "engine.py")], tmp_path)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "no_such_module_xyz (ModuleNotFoundError)" in err


def test_a_bad_command_says_why(tmp_path):
    p = subprocess.run([PY, "-m", "weightcache", "supervise", "--", PY, str(tmp_path / "nope.py")], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "can't open file" in p.stderr


# -- the measurement script, as a smoke test on the CPU ---------------------------------------


def test_supervised_restart_script_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    p = subprocess.run([PY, "-m", "benchmarks", "supervised-restart", "--preset", "tiny", "--device", "cpu", "--restarts", "1",
                        "--workdir", str(tmp_path / "w"), "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["logits_identical"] and len(r["logits_sha256"]) == 1
    s = {k: v["summary"] for k, v in r["series"].items()}
    assert set(s) == {"fresh", "supervised_preload", "supervised_recorded"}
    # A forked engine finds its imports done: what a fresh one spends importing, it does not.
    assert s["supervised_recorded"]["import_s"]["max"] < 0.05 < s["fresh"]["import_s"]["min"]
    assert "from " in r["series"]["supervised_recorded"]["template"]


def test_a_terminals_ctrl_c_reaches_the_engine_once(tmp_path):
    # Ctrl-C on a terminal: the kernel sends SIGINT to the foreground process group, the
    # engine included. The supervisor must not pass on a second one (si_code SI_KERNEL).
    import fcntl
    import termios

    # The engine takes each SIGINT with sigwaitinfo: one taken before a second is sent is
    # not merged with it, as two pending ones would be.
    write(tmp_path / "engine.py", """
        import os, signal
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
        open("ready", "w").write(str(os.getpid()))
        got = [signal.sigwaitinfo([signal.SIGINT])]
        while (info := signal.sigtimedwait([signal.SIGINT], 1.0)) is not None:
            got.append(info)
        open("sigints", "w").write(" ".join("kernel" if i.si_code == 0x80 else f"pid {i.si_pid}" for i in got))
    """)
    master, slave = os.openpty()

    def controlling_terminal():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([PY, "-m", "weightcache", "supervise", "--", PY, str(tmp_path / "engine.py")], cwd=tmp_path, env=env,
                         stdin=slave, stdout=slave, stderr=subprocess.PIPE, text=True, preexec_fn=controlling_terminal)
    os.close(slave)
    try:
        wait_for(lambda: (tmp_path / "ready").exists())
        os.write(master, b"\x03")
        _, err = p.communicate(timeout=30)
    finally:
        os.close(master)
    assert p.returncode == 0, err
    assert (tmp_path / "sigints").read_text() == "kernel"
    assert "SIGINT: stopping the engine" in err


def test_the_engine_gets_sigterm_when_the_supervisor_dies(tmp_path):
    p = supervise([], [str(signalled_engine(tmp_path, term_delay=0))], tmp_path)
    pid = engine_pid(tmp_path)
    p.kill()
    p.wait(timeout=10)
    wait_for(lambda: "SIGTERM" in lines(tmp_path / "signals"), timeout=10)  # PR_SET_PDEATHSIG
    wait_for(lambda: not alive(pid), timeout=10)


def test_systemd_notify_socket_passes_through_to_the_engine(tmp_path):
    import socket

    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    notify.settimeout(20)
    env = {**os.environ, "PYTHONPATH": str(REPO), "NOTIFY_SOCKET": str(tmp_path / "notify")}
    p = supervise([], [str(signalled_engine(tmp_path))], tmp_path, env=env)
    pid = engine_pid(tmp_path)
    got: list[tuple[int, str]] = []  # (sender pid, message)

    def receive_until(check) -> None:  # the engine and the supervisor send in either order
        while not check():
            msg, anc, _, _ = notify.recvmsg(4096, socket.CMSG_SPACE(12))
            sender = next(int.from_bytes(data[:4], "little") for level, kind, data in anc if kind == socket.SCM_CREDENTIALS)
            got.append((sender, msg.decode()))

    receive_until(lambda: any(m == "READY=1" for _, m in got) and any(m.startswith("STATUS=running") for _, m in got))
    assert (pid, "READY=1") in got  # the engine says when the service is ready, not the supervisor
    assert [s for s, m in got if m == "READY=1"] == [pid]
    assert any(s == p.pid and m.startswith("STATUS=running: engine pid") for s, m in got)
    p.send_signal(signal.SIGTERM)
    receive_until(lambda: any(m == "STOPPING=1" for _, m in got))
    assert (p.pid, "STOPPING=1") in got
    assert p.wait(timeout=30) == 0
    notify.close()
