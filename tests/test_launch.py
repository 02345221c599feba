"""zerokit.launch: results, errors named by rank, hangs stopped in time, no orphans, no stderr."""

import os
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import zerokit
from zerokit import LaunchError, LaunchTimeout

pytestmark = pytest.mark.distributed

LAUNCHERS = ["forkserver", "torchrun"]


def _workers_alive():
    """Worker processes of ours still running (the long-lived fork server itself excluded).

    Ours: started with this interpreter. The machine may be shared with other checkouts
    running their own tests, whose torchrun jobs are none of this test's business.
    """
    alive = []
    for p in psutil.process_iter(["cmdline", "status"]):
        argv = p.info["cmdline"] or []
        cmd = " ".join(argv)
        if p.info["status"] == psutil.STATUS_ZOMBIE or not argv or argv[0] != sys.executable:
            continue
        if "zerokit.launcher.worker" in cmd or ("torch.distributed.run" in cmd and "zerokit" in cmd):
            alive.append(p.pid)
    from zerokit.launcher import forkclient

    server = forkclient.running_server()
    if server is not None:
        for kid in psutil.Process(server.pid).children():
            try:
                if kid.status() != psutil.STATUS_ZOMBIE:
                    alive.append(kid.pid)
            except psutil.NoSuchProcess:
                pass  # reaped between listing and asking: it is gone, which is what we check
    return alive


def _sum_ranks(rank, world_size, scale):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    print(f"hello from {rank}")
    return {"rank": rank, "sum": x * scale, "backend": dist.get_backend()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_results_come_back_in_rank_order(launcher, capsys):
    t0 = time.perf_counter()
    out = zerokit.launch(_sum_ranks, world_size=3, args=(10,), launcher=launcher, timeout=90)
    elapsed = time.perf_counter() - t0
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["sum"].item() == 30.0 for o in out)  # (0 + 1 + 2) * 10
    assert {o["backend"] for o in out} == {"gloo"}
    captured = capsys.readouterr()
    assert "[rank 1] hello from 1" in captured.out
    assert captured.err == ""  # nbgrader fails a cell that writes to stderr
    print(f"{launcher}: 3 ranks in {elapsed:.2f} s")
    assert _workers_alive() == []


def test_function_defined_at_run_time_is_sent_by_value():
    # What a notebook cell produces: a function and a class in a module nobody can import.
    namespace = {"__name__": "__main__"}
    exec(
        "class Doubler:\n"
        "    def __init__(self, k): self.k = k\n"
        "    def __call__(self, x): return x * self.k\n"
        "def fn(rank, world_size, k):\n"
        "    return Doubler(k)(rank)\n",
        namespace,
    )
    assert zerokit.launch(namespace["fn"], world_size=2, args=(21,), launcher="forkserver") == [0, 21]


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("bad value on rank one")
    dist.barrier()  # rank 0 would wait here for ever without the launcher
    return rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_exception_on_one_rank_is_reraised_with_its_rank(launcher, capsys):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="bad value on rank one") as info:
        zerokit.launch(_raise_on_one, world_size=2, launcher=launcher, timeout=40)
    assert time.perf_counter() - t0 < 40  # well before the timeout: the job stops at the error
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "rank 1 of 2" in notes and "_raise_on_one" in notes
    assert "bad value on rank one" in str(info.value.__cause__)  # the worker's traceback
    assert info.value.rank == 1
    assert capsys.readouterr().err == ""
    assert _workers_alive() == []


def _hang_on_one(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins this collective
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(3600)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_hang_is_stopped_and_the_stuck_ranks_named(launcher):
    timeout = 8 if launcher == "forkserver" else 20  # torchrun needs a few seconds to start
    t0 = time.perf_counter()
    with pytest.raises(LaunchTimeout) as info:
        zerokit.launch(_hang_on_one, world_size=2, launcher=launcher, timeout=timeout)
    elapsed = time.perf_counter() - t0
    assert timeout <= elapsed < timeout + 10
    message = str(info.value)
    assert "rank 0: never finished: inside torch.distributed.all_reduce" in message
    assert "rank 1: never finished" in message and "_hang_on_one" in message
    assert set(info.value.failures) == {0, 1}
    assert _workers_alive() == []


def _syntax_error(rank, world_size):
    source = "def broken(:\n    pass\n"
    exec(compile(source, "<student cell>", "exec"))


@pytest.mark.timeout(60)
def test_syntax_error_in_sent_code_arrives_as_syntax_error():
    with pytest.raises(SyntaxError) as info:
        zerokit.launch(_syntax_error, world_size=2, launcher="forkserver", timeout=30)
    assert "raised on rank" in "\n".join(info.value.__notes__)


def _crash(rank, world_size):
    if rank == 1:
        os._exit(7)
    dist.barrier()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_rank_that_dies_is_reported_with_its_exit_code(launcher):
    with pytest.raises(LaunchError) as info:
        zerokit.launch(_crash, world_size=2, launcher=launcher, timeout=40)
    assert "rank 1: exited without returning (exit code 7)" in str(info.value)
    assert _workers_alive() == []


def _allocate_forever(rank, world_size):
    hoard = []
    while True:
        hoard.append(torch.ones(2**24))  # 64 MiB, touched


@pytest.mark.timeout(60)
def test_runaway_memory_is_stopped():
    with pytest.raises(LaunchError, match="over the 0.5 GiB limit"):
        zerokit.launch(_allocate_forever, world_size=2, launcher="forkserver", timeout=40, memory_limit_gb=0.5)
    assert _workers_alive() == []


@pytest.mark.timeout(60)
def test_unpicklable_argument_is_a_clear_type_error():
    import threading

    with pytest.raises(TypeError, match="could not send fn/args"):
        zerokit.launch(_sum_ranks, world_size=2, args=(threading.Lock(),), launcher="forkserver")


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="launcher"):
        zerokit.launch(_sum_ranks, world_size=2, launcher="mpirun")
    with pytest.raises(ValueError, match="world_size"):
        zerokit.launch(_sum_ranks, world_size=0)
    with pytest.raises(ValueError, match="backend"):
        zerokit.launch(_sum_ranks, world_size=2, backend="mpi")


def _exit_on_one(rank, world_size, how):
    if rank == 1:
        if how == "exit":
            import sys

            sys.exit(0)
        raise KeyboardInterrupt
    dist.barrier()
    return rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exit", "interrupt"])
def test_sys_exit_on_a_rank_is_a_launch_error_not_the_callers_exit(how):
    # Re-raised as is, SystemExit or KeyboardInterrupt would end this process (a notebook kernel).
    with pytest.raises(LaunchError) as info:
        zerokit.launch(_exit_on_one, world_size=2, args=(how,), launcher="forkserver", timeout=40)
    expected = "called sys.exit(0)" if how == "exit" else "raised KeyboardInterrupt"
    assert f"rank 1 of 2 {expected}" in str(info.value)
    assert set(info.value.failures) == {1}
    assert _workers_alive() == []
    # and this process goes on launching jobs
    assert zerokit.launch(_sum_ranks, world_size=2, args=(1,), launcher="forkserver", echo=False)[1]["rank"] == 1


def _sleep_forever(rank, world_size):
    time.sleep(3600)


@pytest.mark.timeout(90)
def test_no_run_dir_is_left_behind(tmp_path, monkeypatch):
    # launch() makes its run dir with tempfile.mkdtemp(prefix="zerokit-launch-"); a private
    # temp folder keeps other processes' launches out of the count.
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    zerokit.launch(_sum_ranks, world_size=2, args=(1,), launcher="forkserver", echo=False)
    with pytest.raises(ValueError):
        zerokit.launch(_raise_on_one, world_size=2, launcher="forkserver", timeout=30, echo=False)
    with pytest.raises(LaunchTimeout):
        zerokit.launch(_sleep_forever, world_size=2, launcher="forkserver", timeout=4, echo=False)
    assert list(tmp_path.glob("zerokit-launch-*")) == []


def _read_test_var(rank, world_size):
    return os.environ.get("ZEROKIT_TEST_VAR")


@pytest.mark.timeout(60)
def test_forked_ranks_see_variables_set_after_the_server_started(monkeypatch):
    monkeypatch.delenv("ZEROKIT_TEST_VAR", raising=False)
    assert zerokit.launch(_read_test_var, world_size=2, launcher="forkserver") == [None, None]
    monkeypatch.setenv("ZEROKIT_TEST_VAR", "set later")  # undone by monkeypatch after the test
    assert zerokit.launch(_read_test_var, world_size=2, launcher="forkserver") == ["set later"] * 2


def test_describe_frames_names_the_users_line_not_zerokit_helpers():
    from zerokit.launcher import describe_frames

    sep = os.sep
    torch_file = f"{sep}venv{sep}torch{sep}distributed{sep}distributed_c10d.py"
    comm_file = f"{sep}repo{sep}zerokit{sep}comm.py"
    frames = [  # innermost first
        (torch_file, 3000, "all_gather"),
        (comm_file, 50, "all_gather"),
        ("/tmp/ipykernel_123/456.py", 7, "step"),
        (f"{sep}repo{sep}zerokit{sep}launcher{sep}worker.py", 129, "main"),
    ]
    assert describe_frames(frames) == ("all_gather", "your cell, line 7, in step")
    frames[2] = (f"{sep}home{sep}me{sep}train.py", 12, "step")
    assert describe_frames(frames) == ("all_gather", "train.py:12, in step")
    # no frame of the user's at all: the zerokit helper is better than nothing
    assert describe_frames([frames[0], frames[1], frames[3]]) == ("all_gather", "comm.py:50, in all_gather")


_SCRIPT = """import zerokit


def fail(rank, world_size):
    raise ValueError("from the script")


try:
    zerokit.launch(fail, 1, launcher="forkserver", backend="gloo", echo=False)
except ValueError as exc:
    print(exc.__notes__[0])
    print(exc.__cause__)
"""


@pytest.mark.timeout(120)
def test_a_rank_error_names_the_file_of_code_sent_by_value_and_a_cell_as_a_cell(tmp_path):
    """cloudpickle sends a script's functions (its __main__), lambdas and a notebook cell's code by value;
    the report names the line by the file it came from, not "your cell" for all of them (a capstone
    refusal raised in zerokit's train.py read "at your cell, line 440")."""
    from pathlib import Path
    import subprocess

    (tmp_path / "job.py").write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    note, *traceback = done.stdout.splitlines()
    assert note == "raised on rank 0 of 1, at job.py:5, in fail", done.stdout
    assert f'  File "{tmp_path / "job.py"}", line 5, in fail' in traceback, done.stdout  # the rank's own traceback
    # a lambda of this file (by value: it has no importable name)
    divide = lambda rank, world_size: 1 / 0  # noqa: E731
    with pytest.raises(ZeroDivisionError) as caught:
        zerokit.launch(divide, 1, launcher="forkserver", backend="gloo", echo=False)
    line = divide.__code__.co_firstlineno
    assert caught.value.__notes__[0] == f"raised on rank 0 of 1, at test_launch.py:{line}, in <lambda>"
    # a notebook cell's function: its code's file is the kernel's (ipykernel names each cell's)
    cell = {}
    exec(compile("def step(rank, world_size):\n    raise KeyError('batch')\n", "/tmp/ipykernel_1/2.py", "exec"),
         cell)
    with pytest.raises(KeyError) as caught:
        zerokit.launch(cell["step"], 1, launcher="forkserver", backend="gloo", echo=False)
    assert caught.value.__notes__[0] == "raised on rank 0 of 1, at your cell, line 2, in step"


def test_torchrun_that_cannot_start_is_a_launch_error(monkeypatch):
    import subprocess

    def no_such_program(*args, **kwargs):
        raise FileNotFoundError("no such file: python")

    monkeypatch.setattr(subprocess, "Popen", no_such_program)
    with pytest.raises(LaunchError, match="torchrun could not be started.*no such file"):
        zerokit.launch(_sum_ranks, world_size=2, args=(1,), launcher="torchrun", backend="gloo")


def test_a_dead_fork_server_is_a_launch_error(monkeypatch):
    import io
    import tempfile

    from zerokit.launcher import forkclient

    class DeadPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    class DeadProcess:
        pid = -1
        stdin, stdout = DeadPipe(), io.StringIO("")

        def poll(self):
            return -9

    stderr = tempfile.TemporaryFile()
    stderr.write(b"Fatal Python error: Segmentation fault\n")
    stderr.flush()
    dead = forkclient.ForkServer(DeadProcess(), stderr)
    monkeypatch.setattr(forkclient, "server", lambda pythonpath: dead)
    with pytest.raises(LaunchError, match="fork server stopped answering") as info:
        zerokit.launch(_sum_ranks, world_size=2, args=(1,), launcher="forkserver", backend="gloo")
    assert "Segmentation fault" in str(info.value)  # its stderr, quoted
    stderr.close()


@pytest.mark.timeout(120)
def test_a_fork_server_that_cannot_start_says_why(monkeypatch):
    from zerokit.launcher import forkclient

    # hide this process's running server (monkeypatch puts it back), then start a broken one
    monkeypatch.setattr(zerokit, forkclient._HANDLE, None, raising=False)
    monkeypatch.setattr(forkclient, "SERVER_MODULE", "zerokit.no_such_module")
    with pytest.raises(LaunchError) as info:
        zerokit.launch(_sum_ranks, world_size=2, args=(1,), launcher="forkserver", backend="gloo")
    message = str(info.value)
    assert "fork server exited (exit code 1) before it was ready" in message
    assert "No module named zerokit.no_such_module" in message  # the tail of its stderr
    assert getattr(zerokit, forkclient._HANDLE) is None  # a failed server is not kept


def test_a_fork_server_that_never_says_ready_is_stopped_in_time():
    from zerokit.launcher.forkclient import ForkServer

    marker = "zerokit-test-silent-server"
    command = [sys.executable, "-c", f"import sys, time; print('{marker}', file=sys.stderr, flush=True); "
                                     "time.sleep(600)"]
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"did not say it was ready within 2 s(.|\n)*" + marker):
        ForkServer.start(command, dict(os.environ), ready_within=2)
    assert time.perf_counter() - t0 < 10
    left = [p for p in psutil.Process().children() if marker in " ".join(p.cmdline())]
    assert left == []  # killed, not left sleeping


# What the notebooks' hidden test cells do before each check: drop every zerokit.grading and
# zerokit.launcher module and import them afresh. Run in a process of its own, like a kernel.
_REIMPORT = """
import importlib, json, sys
import psutil
import zerokit
from zerokit.launcher import forkclient

def servers():
    return [p.pid for p in psutil.Process().children() if forkclient.SERVER_MODULE in " ".join(p.cmdline())]

assert zerokit.launch(lambda r, n: r, world_size=2, launcher="forkserver", echo=False) == [0, 1]
first = forkclient.running_server().pid
for _m in [m for m in sys.modules if m.startswith(("zerokit.grading", "zerokit.launcher"))]:
    del sys.modules[_m]
launcher = importlib.import_module("zerokit.launcher")
assert launcher.launch(lambda r, n: 10 * r, world_size=2, launcher="forkserver", echo=False) == [0, 10]
importlib.import_module("zerokit.grading.harness")  # the checks launch through zerokit.launcher
assert zerokit.launch(lambda r, n: 20 * r, world_size=2, launcher="forkserver", echo=False) == [0, 20]
fresh = importlib.import_module("zerokit.launcher.forkclient")
print(json.dumps({"first": first, "after": fresh.running_server().pid, "servers": servers(),
                  "fresh_module": fresh is not forkclient}))
"""


@pytest.mark.timeout(180)
def test_reimporting_the_launcher_keeps_the_one_fork_server():
    import json
    import subprocess

    done = subprocess.run([sys.executable, "-c", _REIMPORT], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["fresh_module"]  # the re-import really made new modules
    assert seen["after"] == seen["first"]  # ... and they found the server already running
    assert seen["servers"] == [seen["first"]]  # one server, not one per import
    # and it ends with the process that started it (EOF on its stdin)
    from zerokit.launcher.processes import alive

    end = time.monotonic() + 15
    while time.monotonic() < end and alive(seen["first"]):
        time.sleep(0.1)
    assert not alive(seen["first"])


# In a kernel the grader starts (grading/autograde/kernel.py): its fork server is its own
# child, forked before ipykernel started (zerokit.launcher.preforked), not a second Python.
_IN_KERNEL = """
import json, os, sys
import psutil
import zerokit
from zerokit.launcher import forkclient
server = forkclient.running_server()
results = zerokit.launch(lambda r, n: 3 * r, world_size=2, launcher="forkserver", echo=False)
print(json.dumps({"kernel": os.getpid(), "server": server.pid, "server_parent": psutil.Process(server.pid).ppid(),
                  "same_server": forkclient.running_server() is server, "results": results,
                  "other_servers": [p.pid for p in psutil.Process().children(recursive=True)
                                    if forkclient.SERVER_MODULE in " ".join(p.cmdline())]}))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("started_by", ["grader", "nbmake"])
def test_a_preforked_kernel_forks_its_own_fork_server(tmp_path, pytestconfig, started_by):
    """The grader's kernels, and the kernel nbmake runs the solution notebooks in (tests/jupyter)."""
    import asyncio
    import json

    from jupyter_client.manager import AsyncKernelManager

    from conftest import KERNEL
    from zerokit.grading.autograde.kernel import GradingKernelManager
    from zerokit.launcher.processes import alive

    async def run():
        if started_by == "grader":
            km = GradingKernelManager(socket_dir=str(tmp_path), workdir=str(tmp_path))
        else:
            # the kernel nbmake will run the notebooks in (without nbmake, -p no:nbmake, none)
            assert getattr(pytestconfig.option, "nbmake_kernel", KERNEL) == KERNEL
            km = AsyncKernelManager(kernel_name=KERNEL)
        await km.start_kernel()
        kc = km.client()
        kc.start_channels()
        out = []
        try:
            await kc.wait_for_ready(timeout=90)
            reply = await kc.execute_interactive(_IN_KERNEL, timeout=90, output_hook=lambda m: out.append(m))
            assert reply["content"]["status"] == "ok", reply["content"]
        finally:
            kc.stop_channels()
            await km.shutdown_kernel(now=True)
        return "".join(m["content"].get("text", "") for m in out if m["msg_type"] == "stream")

    seen = json.loads(asyncio.run(run()).splitlines()[-1])
    assert seen["results"] == [0, 3]
    assert seen["server_parent"] == seen["kernel"]  # forked by the kernel itself ...
    assert seen["same_server"] and seen["other_servers"] == []  # ... and no second server started
    end = time.monotonic() + 15  # it ends with the kernel (EOF on its pipe)
    while time.monotonic() < end and alive(seen["server"]):
        time.sleep(0.1)
    assert not alive(seen["server"])


def test_ranks_that_fail_and_exit_between_two_polls_are_an_error_not_a_result(tmp_path):
    """The poll loop's race, made certain: the ranks write their results (one an error) and exit
    after a poll found nothing and before the job is seen done. The error must be raised; once it
    was handed back as rank 0's return value, and a failing grading check passed under load."""
    import cloudpickle

    from zerokit.launcher import runner
    from zerokit.launcher.ranks import Rank

    ranks = [Rank(r, tmp_path) for r in range(2)]

    class FinishesUnseen:  # done() is asked once the poll has found no result yet
        def start(self, ranks):
            pass

        def done(self, ranks):
            for r, result in zip(ranks, [("error", {"message": "planted"}), ("ok", 1)]):
                r.file("result").write_bytes(cloudpickle.dumps(result))
            return True

    outcome, _ = runner._run(FinishesUnseen(), ranks, timeout=10, memory_limit_gb=None, echo=False)
    assert outcome == "error", outcome
