"""SIGTERM and Ctrl-C to a process that runs a :class:`Harness` (``carpool demo``, bench, soak): the
redis-server, coordinators and workers it started are stopped, not left running with no parent, and
``carpool`` exits 128 + the signal without a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses; the rest follows the last ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def _wait_for_children(proc: subprocess.Popen[str], count: int, timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        kids = _children(proc.pid)
        if len(kids) >= count:
            return kids
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"exited with {proc.returncode} before starting {count} children:\n{out}\n{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"{len(kids)} of {count} children after {timeout_s}s")
        time.sleep(0.1)


def _gone(pids: set[int], timeout_s: float = 10) -> set[int]:
    """Those of ``pids`` still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {pid for pid in pids if _alive(pid)}


@pytest.fixture
def leftovers() -> Iterator[set[int]]:
    """Pids a test adds are killed at its end, whatever happened (an orphan must not outlive it)."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _embedded_env() -> dict[str, str]:
    """``carpool demo``'s environment for its own embedded redis-server and the toy model."""
    env = {**os.environ, "CARPOOL_MODEL": "toy", "CARPOOL_MODELS": "toy", "CARPOOL_METRICS_PORT": "0"}
    env.pop("CARPOOL_BROKER_URL", None)
    env.pop("CARPOOL_RESULT_BACKEND", None)
    return env


def _signalled(
    command: list[str], sig: signal.Signals, leftovers: set[int], start_s: float = 60
) -> tuple[subprocess.Popen[str], str, set[int]]:
    """Run ``command`` (a process that starts a harness), send it ``sig`` once it runs its redis-server,
    coordinator and worker and a moment more; the process, its stderr and the children it had."""
    proc = subprocess.Popen(
        command, env=_embedded_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    leftovers.add(proc.pid)
    try:
        kids = _wait_for_children(proc, 3, timeout_s=start_s)  # redis-server, coordinator, worker
        leftovers.update(kids)
        time.sleep(2)  # into waiting for the worker, or the load
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc, err, kids


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_carpool_demo_stopped_by_a_signal_stops_its_redis_coordinator_and_worker(
    sig: signal.Signals, status: int, leftovers: set[int]
) -> None:
    # SIGINT to the demo alone (not its process group, as Ctrl-C would): its children get nothing
    # but what the demo sends them.
    demo, err, kids = _signalled(
        [sys.executable, "-m", "carpool", "demo", "--requests", "20000"], sig, leftovers
    )
    assert demo.returncode == status, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"carpool demo: stopped by {sig.name}"
    assert not _gone(kids), f"left running: {_gone(kids)}"


_HARNESS_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from carpool.tools.harness import Harness

    SLEEPER = ["timeit", "-n", "1", "-r", "1", "import time; time.sleep(120)"]
    if sys.argv[1] == "with":  # demo and bench
        with Harness(loglevel="warning") as h:
            h.spawn("a", SLEEPER)
            h.spawn("b", SLEEPER)
            print("ready", flush=True)
            time.sleep(120)
    else:  # the soak's: a harness on a server started for it, closed in a finally
        from carpool.tools.embedded import EmbeddedRedis

        server = EmbeddedRedis().start()
        h = Harness(server=server)
        try:
            h.spawn("a", SLEEPER)
            h.spawn("b", SLEEPER)
            print("ready", flush=True)
            time.sleep(120)
        finally:
            h.close()
            server.cleanup()
    """
)


@pytest.mark.parametrize("usage", ["with", "finally"])
def test_sigterm_to_a_harness_process_stops_every_child_then_exits(usage: str, leftovers: set[int]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HARNESS_SCRIPT, usage],
        env=_embedded_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    leftovers.add(proc.pid)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        kids = _children(proc.pid)
        leftovers.update(kids)
        assert len(kids) == 3  # the redis-server and two sleepers
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0 and "Terminated" in err  # it raised, and unwound through close()
    assert not _gone(kids), f"left running: {_gone(kids)}"


def test_a_harness_closed_off_the_main_thread_leaves_sigterm_as_it_was() -> None:
    """Only the main thread can put a signal handler back: the trap's own handler does it, then
    delivers the SIGTERM again to what was there before (here the default: the process ends)."""
    script = textwrap.dedent(
        """
        import os, signal, threading, time
        from carpool.tools.harness import Harness

        h = Harness(broker_url="redis://127.0.0.1:1/0", result_backend="redis://127.0.0.1:1/1")
        h.spawn("sleeper", ["http.server", "0", "--bind", "127.0.0.1"])
        closing = threading.Thread(target=h.close)
        closing.start()
        closing.join()
        print("closed", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("still running")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)
    assert "closed" in proc.stdout and "still running" not in proc.stdout


def test_python_dash_m_soak_stopped_by_sigterm_ends_as_carpool_soak_does(
    leftovers: set[int], tmp_path: Path
) -> None:
    """``python -m carpool.tools.soak`` goes through ``carpool``'s entry point: SIGTERM stops what
    its harness started and it exits 143 with one line, as ``carpool soak`` does (a ``Terminated``
    traceback before)."""
    command = [sys.executable, "-m", "carpool.tools.soak", "--short", "--out", str(tmp_path / "soak")]
    soak, err, kids = _signalled(command, signal.SIGTERM, leftovers, start_s=90)
    assert soak.returncode == 143, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "carpool soak: stopped by SIGTERM"
    assert not _gone(kids), f"left running: {_gone(kids)}"
