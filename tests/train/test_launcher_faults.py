"""What happens to a job when a process of it dies or stops (issue 47, items 2, 4 and 5).

Unit level first: a worker ends with its launcher however the launcher ends (the parent-death
signal, on processes that never import torch), and the launcher's summary names the failure that
ended the job, not the workers it stopped afterwards (torchrun's failures, faked). Then three runs
of the README's launch (`python -m cpcompile train --nproc-per-node 2`, a tiny Qwen3, CP=2), each
hit once it trains: the launcher killed with SIGKILL (its workers end, and the lock they leave is
stale and named), the launcher interrupted with SIGINT (one line), and rank 0 stopped with
SIGSTOP (the job ends a few seconds after the collective timeout, naming rank 0 and the
collective, where torchrun alone waited 30 s more and the workers said nothing). Linux only: the
processes are found in /proc."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import yaml

from cp_harness import sdpa_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIFETIME = os.path.join(ROOT, "cpcompile", "worker_lifetime.py")
QWEN3 = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
TIMEOUT_S = 3
WAIT_S = 60  # the longest any process below is waited for (a bound on a stuck test, not a timing)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes in /proc")


def _gone(pid: int) -> bool:
    """The process has ended: every thread of it (a zombie not yet reaped by its new parent has
    ended too). The leader alone is not enough: it shows `Z` while its other threads still exit,
    and they hold its open files, the checkpoint lock among them, until the last one is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    return all(_task_state(pid, task) in ("Z", "X", None) for task in tasks)


def _task_state(pid: int, task: str):
    try:
        with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.1)


# --------------------------------------------------------------------------- a worker ends with its launcher

# A launcher that starts two workers (one asking to end with it, one not) and waits; the workers
# run worker_lifetime.py by its path: no torch, so the whole test takes well under a second.
LAUNCHER = """
import os, subprocess, sys, time
env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "CPCOMPILE_LAUNCHER_PID": str(os.getpid())}
worker = "import runpy, sys, time; m = runpy.run_path(sys.argv[1]); {call}; print('ready', flush=True); time.sleep(600)"
kids = [subprocess.Popen([sys.executable, "-c", worker.format(call=call), sys.argv[1]], env=env,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
        for call in ("m['end_with_launcher']()", "None")]
for kid in kids:
    assert kid.stdout.readline() == "ready\\n"
print(" ".join(str(kid.pid) for kid in kids), flush=True)
time.sleep(600)
"""


def test_a_worker_ends_when_its_launcher_is_killed():
    """SIGKILL to the launcher (nothing of it runs): the worker that asked for the parent-death
    signal ends; one that did not lives on, an orphan (what happened before, and the control that
    shows the test can fail)."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, LIFETIME], stdout=subprocess.PIPE, text=True)
    asked, plain = (int(pid) for pid in launcher.stdout.readline().split())
    try:
        launcher.kill()
        launcher.wait()
        _wait_until(lambda: _gone(asked), "the worker to end with its launcher")
        assert not _gone(plain)
    finally:
        os.kill(plain, signal.SIGKILL)


def test_outside_a_launcher_nothing_is_asked():
    from cpcompile import worker_lifetime

    names = (worker_lifetime.TORCHRUN_WORKER, worker_lifetime.LAUNCHER_PID)
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    os.environ[worker_lifetime.LAUNCHER_PID] = "1"  # left in a shell's environment: not a worker without torchrun's
    try:
        assert worker_lifetime.end_with_launcher() is None
    finally:
        os.environ.pop(worker_lifetime.LAUNCHER_PID)
        os.environ.update(saved)


# --------------------------------------------------------------------------- the launcher's summary


def _failure(local_rank: int, exitcode: int, report: dict | None = None):
    """Like torchrun's `ProcessFailure`, with what a worker wrote (`launch.write_worker_report`)."""
    name = signal.Signals(-exitcode).name if exitcode < 0 else ""
    data = {"message": "", "cpcompile": report} if report else {}
    return SimpleNamespace(local_rank=local_rank, exitcode=exitcode, error_file_data=data, signal_name=lambda: name)


def _report(line: str, consequence: bool, at: float, status: int = 2) -> dict:
    return {"line": line, "status": status, "consequence": consequence, "time": at}


@pytest.mark.parametrize("failures, first_failed, line, status", [
    # rank 1 killed; rank 0 stopped by the launcher afterwards (the issue: "rank 0 ended by SIGTERM")
    ({1: _failure(1, -9), 0: _failure(0, -15)}, {1}, "cpcompile train: error: rank 1 ended by SIGKILL; the other "
                                                     "workers were stopped", 1),
    # rank 1 killed, and rank 0 saw its peer go before the launcher looked: the kill is the cause
    ({0: _failure(0, 2, _report("rank 1 left the job", True, 5.0)), 1: _failure(1, -9)}, {0, 1},
     "cpcompile train: error: rank 1 ended by SIGKILL; the other workers were stopped", 1),
    # rank 0 stopped (SIGSTOP): rank 1 timed out and said so; rank 0 killed afterwards
    ({1: _failure(1, 2, _report("rank 0 did not arrive", True, 4.0)), 0: _failure(0, -9)}, {1},
     "rank 0 did not arrive", 2),
    # a disk full on both ranks, and a lost peer: the cause, the earliest of it
    ({0: _failure(0, 2, _report("disk full (rank 0)", False, 3.5)), 1: _failure(1, 2, _report("disk full", False, 3.0)),
      2: _failure(2, 2, _report("rank 1 left", True, 2.0))}, None, "disk full", 2),
    ({0: _failure(0, 1, _report("FAIL: train.verify", False, 1.0, status=1))}, {0}, "FAIL: train.verify", 1),
    # a worker sent SIGINT by hand (not through the launcher): said, not a silent 130
    ({1: _failure(1, 130, _report("rank 1 was interrupted by SIGINT", False, 1.0, status=130)), 0: _failure(0, -15)},
     {1}, "rank 1 was interrupted by SIGINT", 130),
])
def test_the_summary_names_the_failure_that_ended_the_job(capsys, failures, first_failed, line, status):
    from cpcompile.launch import _status_of

    assert _status_of(failures, "train", first_failed) == status
    assert capsys.readouterr().err == line + "\n"


def test_the_launcher_stops_workers_quickly_and_notes_who_failed_first():
    """torchrun's closing of the workers, inside `_quick_stop`: its 30 s wait between SIGTERM and
    SIGKILL becomes `STOP_GRACE_S`, and the ranks failed when it began are noted."""
    from torch.distributed.elastic.multiprocessing import api

    from cpcompile.launch import STOP_GRACE_S, _quick_stop

    calls, first_failed = [], {}
    context = SimpleNamespace(_failures={1: "failed"}, _close=lambda death_sig, timeout: calls.append(timeout),
                              _tail_logs=[], filtered_stdout=None, filtered_stderr=None)  # what close reads
    with _quick_stop(first_failed):
        api.PContext.close(context)
        context._failures[0] = "stopped by the launcher"
        api.PContext.close(context)
    api.PContext.close(context)  # after torchrun: its own wait again
    assert calls == [STOP_GRACE_S, STOP_GRACE_S, 30] and first_failed == {"local_ranks": {1}}, (calls, first_failed)


# --------------------------------------------------------------------------- the real launch, hit while it trains


def _start(tmp_path) -> tuple[subprocess.Popen, dict, str]:
    """The README's launch of a long run; -> the launcher, its workers by rank (pid), the
    checkpoint folder, once step 3 has run."""
    folder = str(tmp_path / "ckpt")
    config = {"model": QWEN3, **sdpa_plan(2), "checkpoint": {"folder": folder, "interval": 2},
              "train": {"steps": 100000, "seq_len": 16, "batch_size": 1, "collective_timeout_s": TIMEOUT_S}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    path_list = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path_list}
    out, err = open(tmp_path / "out.txt", "w"), open(tmp_path / "err.txt", "w")
    launcher = subprocess.Popen([sys.executable, "-m", "cpcompile", "train", "--nproc-per-node", "2", str(path)],
                                stdout=out, stderr=err, env=env, cwd=ROOT)
    _wait_until(lambda: "step 3/" in (tmp_path / "out.txt").read_text() or launcher.poll() is not None, "step 3")
    assert launcher.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
    return launcher, _workers(launcher.pid), folder


def _workers(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's children (read from /proc)."""
    children = []
    for task in os.listdir(f"/proc/{launcher}/task"):
        with open(f"/proc/{launcher}/task/{task}/children", encoding="ascii") as handle:
            children += [int(pid) for pid in handle.read().split()]
    ranks = {}
    for pid in children:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            env = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
        ranks[int(env[b"RANK"])] = pid
    assert sorted(ranks) == [0, 1], ranks
    return ranks


def test_killing_the_launcher_ends_its_workers_and_leaves_a_stale_lock(tmp_path):
    """The issue's `kill -9` of the launcher: its workers trained on and wrote checkpoints. Now
    they end, and the lock rank 0 held is left stale, naming rank 0's pid: the next job is not
    refused and says whose it was."""
    from cpcompile.trainer import lock

    launcher, workers, folder = _start(tmp_path)
    launcher.kill()
    launcher.wait()
    for pid in workers.values():
        _wait_until(lambda: _gone(pid), f"worker {pid} to end")
    lock.check_free(folder)
    lines: list = []
    with lock.holding(folder, log=lines.append):
        pass
    assert len(lines) == 1 and f"took over the stale lock {folder}/cpcompile.lock" in lines[0], lines
    assert f"pid {workers[0]} on host " in lines[0], lines


def test_sigint_to_the_launcher_is_one_line(tmp_path):
    """Ctrl-C: torchrun forwards SIGINT to the workers, which end without a traceback; the
    launcher says so in one line, naming where a resume starts, and exits 130."""
    launcher, workers, folder = _start(tmp_path)
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(WAIT_S) == 130
    err = (tmp_path / "err.txt").read_text()
    assert err.count("\n") == 1 and err.startswith("cpcompile train: interrupted by SIGINT: the workers were "
                                                   f"stopped; a resume starts from {folder}/step-"), err
    assert all(_gone(pid) for pid in workers.values())


def test_a_stopped_rank_0_ends_the_job_soon_after_the_timeout_naming_it(tmp_path):
    """SIGSTOP to rank 0 (as a hung process): rank 1 times out, names rank 0, where it was and
    the collective; the launcher prints that one line and kills the stopped rank after its short
    grace. Before, the job ended 30 s later than this bound and said nothing."""
    launcher, workers, _ = _start(tmp_path)
    os.kill(workers[0], signal.SIGSTOP)
    stopped = time.monotonic()
    status = launcher.wait(WAIT_S)
    ended = time.monotonic() - stopped
    err = (tmp_path / "err.txt").read_text()
    assert status == 2 and err.count("\n") == 1, err
    assert "cpcompile train: error: step " in err and "rank 0 (its last position: step " in err, err
    assert "did not arrive at gloo:" in err and f"within train.collective_timeout_s={TIMEOUT_S} s" in err, err
    assert ended < TIMEOUT_S + 20, (ended, err)  # about timeout + 7 s; torchrun's own close alone waits 30
    assert all(_gone(pid) for pid in workers.values())
