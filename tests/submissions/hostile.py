"""Cells of submissions written to break the grader rather than to learn (lesson 00's examples).

Each attempt prints one line, "hostile <what>: <outcome>", which tests/test_autograde.py
reads back from the autograded notebook: behind the wall every attempt must fail, and with
--no-sandbox the grader must catch what got through. None of them may harm the machine the
tests run on when the attempt succeeds (no kill(-1), no writes outside the course copy).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The line a detached process carries in its command line, so a test can look for survivors.
DETACHED_MARKER = "zerokit-hostile-detached-process"
# Written beside the notebook by a test: the port of a listener on the grader's loopback.
LISTENER_FILE = "listener_port.txt"

# Before the test cells: rewrite a check's comparison so that it always passes (the hidden
# tests import the checks afresh from disk), wreck the hidden tests' source, plant a file in
# lessons/, read the hidden tests, and look for another student's notebook.
WRITES = '''import pathlib
import zerokit
import zerokit.grading.compare as compare

course = pathlib.Path(zerokit.__file__).resolve().parents[1]
source = course / "solutions" / "00_collectives" / "00_collectives.ipynb"
attempts = {
    "zerokit/grading/compare.py": lambda: pathlib.Path(compare.__file__).write_text(
        pathlib.Path(compare.__file__).read_text() + "\\n\\ndef assert_close(*args, **kwargs):\\n    return None\\n"),
    "solutions/": lambda: source.write_text("{}"),
    "lessons/": lambda: (course / "lessons" / "00_collectives" / "planted.txt").write_text("planted"),
}
for what, attempt in attempts.items():
    try:
        attempt()
        print(f"hostile write {what}: done")
    except OSError as exc:
        print(f"hostile write {what}: failed ({type(exc).__name__})")
try:
    print(f"hostile read solutions/: done ({len(source.read_text())} characters of hidden tests)")
except OSError as exc:
    print(f"hostile read solutions/: failed ({type(exc).__name__})")
# another student's notebook, wherever it is: a bounded search of the usual places
import os
found, seen = None, 0
for top in ("/tmp", "/work", "/home", "/root", "/srv"):
    for folder, _, names in os.walk(top):
        seen += len(names)
        if "00_collectives.ipynb" in names and not folder.startswith(os.getcwd()):
            found = os.path.join(folder, "00_collectives.ipynb")
        if found or seen > 20000:
            break
    if found:
        break
print(f"hostile read other submissions: {f'done ({found})' if found else 'failed (none in sight)'}")
'''

# Before the test cells: a process that leaves the kernel's session, process group and
# environment (a double fork, setsid, an empty environment), and connections to the grader's
# loopback and beyond the machine (to a documentation address, so nothing real is contacted
# when the wall is down).
PROCESSES = f'''import os, socket, subprocess, sys

daemon = "import os, time\\nif os.fork():\\n    os._exit(0)\\nos.setsid()\\nwhile True:\\n    time.sleep(1)\\n"
subprocess.Popen([sys.executable, "-c", daemon + "# {DETACHED_MARKER}"], env={{}}, start_new_session=True,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("hostile detached process: started")

targets = [("beyond this machine", ("192.0.2.1", 80))]  # TEST-NET-1: routable nowhere, never answered
if os.path.exists("{LISTENER_FILE}"):
    targets.append(("the grader's loopback", ("127.0.0.1", int(open("{LISTENER_FILE}").read()))))
for what, address in targets:
    try:
        socket.create_connection(address, timeout=2).close()
        print(f"hostile connect {{what}}: done")
    except OSError as exc:
        print(f"hostile connect {{what}}: failed ({{type(exc).__name__}})")
'''

# After the test cells: kill the process that runs this kernel (the grader) and its process
# group. Its pid is taken once, first: never pid 1 or a group of 1 (kill(-1) is everyone).
# First a temporary folder the kernel never removes, as a launch() killed in the middle leaves its
# run folder: it must go with the grader's scratch folder, not stay in the instructor's $TMPDIR.
KILL_GRADER = '''import os, signal, tempfile

tempfile.mkdtemp(prefix="zerokit-hostile-left-")  # not an attempt that can fail: test_autograde lists those
parent = os.getppid()
group = os.getpgid(parent)
if parent > 1 and group > 1:
    for what, attempt in (("process group", lambda: os.killpg(group, signal.SIGKILL)),
                          ("parent", lambda: os.kill(parent, signal.SIGKILL))):
        try:
            attempt()
            print(f"hostile kill {what}: done")
        except OSError as exc:
            print(f"hostile kill {what}: failed ({type(exc).__name__})")
else:
    print(f"hostile kill parent: failed (the kernel's parent is pid {parent}: the grader is out of sight)")
'''


def planted_zerokit():
    """A copy of the installed zerokit, planted beside the notebook, whose comparison never fails."""
    files = {}
    for path in sorted((ROOT / "zerokit").rglob("*.py")):
        files[str(path.relative_to(ROOT))] = path.read_text()
    compare = "zerokit/grading/compare.py"
    files[compare] += "\n\ndef assert_close(*args, **kwargs):  # planted: never fails\n    return None\n"
    return files
