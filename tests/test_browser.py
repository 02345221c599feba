"""The course in a real browser: JupyterLab in headless Chromium, driven as a student would.

A JupyterLab server starts on a free localhost port with a token, on a scratch copy of the
course (so nothing it saves lands in the repository); Playwright drives the system's
Chromium (`apt-get install chromium`: `make test` installs it when missing). Checked:
- a representative set of lessons (the first, and enough others that every widget the
  lessons display is shown at least once: `representative_lessons`) opens with the
  course's kernel, and Run All on its solution notebook ends with no error and nothing on
  stderr, every code cell executed. nbmake executes every solution notebook end to end
  already; what the browser adds is the widgets' front end, so every widget is covered
  and a lesson that shows nothing new is not run twice;
- the memory calculator's N slider, moved with the keyboard, shows zerokit.theory_bytes'
  value for the new N; the shard map redraws when its slider moves;
- nbgrader's Validate button on a completed lesson reports success.
Screenshots of each lesson go to test-artifacts/browser/.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import chromium, students_env
from zerokit import widgets
from zerokit.grading.lessons import lesson_ids
from zerokit.memory import theory_bytes

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "browser"
TOKEN = "zerokit-browser-test"


def _widgets_called(lesson):
    """The zerokit.widgets functions the lesson's solution notebook calls."""
    text = (ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text()
    return {name for name in widgets.__all__ if re.search(rf"\b{name}\(", text)}


def representative_lessons():
    """The first lesson, then (greedily) lessons until every zerokit.widgets function some
    lesson calls is called by one of them."""
    calls = {lesson: _widgets_called(lesson) for lesson in lesson_ids()}
    chosen = [lesson_ids()[0]]
    missing = set().union(*calls.values()) - calls[chosen[0]]
    while missing:
        best = max(sorted(calls), key=lambda lesson: len(calls[lesson] & missing))
        chosen.append(best)
        missing -= calls[best]
    return sorted(chosen)


def test_the_representative_lessons_show_every_widget_the_lessons_use():
    chosen = representative_lessons()
    assert chosen[0] == lesson_ids()[0]
    shown = set().union(*(_widgets_called(lesson) for lesson in chosen))
    assert {"memory_calculator", "shard_map", "step_timeline", "progress"} <= shown, shown


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """A scratch copy of the course the server works on: solutions, and a widgets notebook."""
    root = tmp_path_factory.mktemp("lab")
    for lesson in lesson_ids():
        shutil.copytree(ROOT / "solutions" / lesson, root / lesson)
    return root


@pytest.fixture(scope="module")
def lab(course):
    port = _free_port()
    log = open(course / "lab.log", "w")
    # user settings of its own: no "would you like news?" toast over the notebook, and every
    # cell in the page (JupyterLab otherwise renders only the cells in view)
    settings = course.parent / f"{course.name}-settings"
    for plugin, values in (("apputils-extension/notification", '{"fetchNews": "false", "checkForUpdates": false}'),
                           ("notebook-extension/tracker", '{"windowingMode": "none"}')):
        path = settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(values)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={course}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=students_env(JUPYTERLAB_SETTINGS_DIR=str(settings)))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"JupyterLab exited: {(course / 'lab.log').read_text()[-2000:]}")
                time.sleep(0.2)
        else:
            raise RuntimeError("JupyterLab did not answer within 60 s")
        yield url
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser():
    with chromium() as launched:
        yield launched


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    yield page
    page.close()


def _open(page, lab, path):
    # a workspace of its own, reset: only this notebook open, not the last test's too
    page.goto(f"{lab}/lab/workspaces/{abs(hash(path))}/tree/{path}?reset&token={TOKEN}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=60_000)
    # the kernel: the course's (this interpreter's) python3, started and idle
    page.wait_for_function("() => (document.querySelector('.jp-NotebookPanel-toolbar .jp-KernelName') || {})"
                           ".innerText?.startsWith('Python 3')", timeout=60_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)


def _run_all(page, timeout_s):
    """Run All Cells; return the input prompts once nothing runs or waits any more."""
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='busy']", timeout=60_000)
    page.wait_for_function(  # a running or queued cell shows [*]; an error stops the queue
        "() => document.querySelector('.jp-Notebook-ExecutionIndicator')?.dataset.status == 'idle'"
        " && ![...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].some(p => p.innerText.includes('*'))",
        timeout=timeout_s * 1000, polling=500)
    return page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()


def _problems(page):
    """Error outputs and stderr output anywhere in the open notebook."""
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']").all_inner_texts()
    stderr = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
    return errors + stderr


@pytest.mark.timeout(900)
@pytest.mark.parametrize("lesson", representative_lessons())
def test_run_all_on_each_solution_notebook_finishes_without_errors(page, lab, lesson):
    _open(page, lab, f"{lesson}/{lesson}.ipynb")
    prompts = _run_all(page, timeout_s=300)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{lesson}.png"))
    assert _problems(page) == []
    assert prompts and all(p.strip() not in ("[ ]:", "") for p in prompts), f"cells not executed: {prompts}"


WIDGETS = """from zerokit import widgets
widgets.memory_calculator(psi=7.5e9, world_size=64, stage="zero3", precision="mixed", device_gb=80)"""
SHARDS = """def floor_shards(numel, world_size, rank):
    size = numel // world_size
    return rank * size, (rank + 1) * size
widgets.shard_map([5, 2, 4], world_size=3, shard_range=floor_shards)"""


def _shown_bytes(page):
    return float(page.locator(".zerokit-memory-total").first.get_attribute("data-bytes"))


@pytest.mark.timeout(300)
def test_the_memory_calculator_follows_its_slider_and_the_shard_map_redraws(page, lab, course):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(WIDGETS), nbformat.v4.new_code_cell(SHARDS)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, course / "widgets.ipynb")
    _open(page, lab, "widgets.ipynb")
    _run_all(page, timeout_s=120)
    calculator = page.locator(".zerokit-memory-calculator")
    calculator.wait_for(timeout=30_000)
    assert _shown_bytes(page) == pytest.approx(theory_bytes(7.5e9, "zero3", 64, "mixed")["total"])
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    calculator.screenshot(path=str(ARTIFACTS / "memory_calculator.png"))  # the paper's example (the README's)
    # the N slider (the calculator's first integer slider): focus its handle, step it right
    handle = calculator.locator(".widget-slider .noUi-handle").nth(1)
    handle.focus()
    for n in (65, 66):
        page.keyboard.press("ArrowRight")
        page.wait_for_function(
            f"document.querySelector('.zerokit-memory-total').dataset.bytes != "
            f"'{theory_bytes(7.5e9, 'zero3', n - 1, 'mixed')['total']:.0f}'", timeout=30_000)
        assert _shown_bytes(page) == pytest.approx(theory_bytes(7.5e9, "zero3", n, "mixed")["total"])
    shard_map = page.locator(".zerokit-shard-map")
    before = shard_map.locator("img").get_attribute("src")
    shard_map.locator(".noUi-handle").first.focus()
    page.keyboard.press("ArrowRight")
    page.wait_for_function("before => document.querySelector('.zerokit-shard-map img').src != before",
                           arg=before, timeout=30_000)
    page.screenshot(path=str(ARTIFACTS / "widgets.png"), full_page=True)


@pytest.mark.timeout(540)  # 36 s alone, 110 s beside the grading under `make test`'s two workers
def test_nbgrader_validate_reports_success_on_a_completed_lesson(page, lab, course):
    from tests import submissions

    lesson = "00_collectives"  # the quickest lesson to validate: nbgrader runs it all again
    module = submissions.lesson_modules()[lesson]
    correct = next(s for s in module.STUDENTS if s.id == "correct")
    (course / "completed").mkdir()
    (course / "completed" / f"{lesson}.ipynb").write_text(json.dumps(submissions.notebook(lesson, correct)))
    _open(page, lab, f"completed/{lesson}.ipynb")
    page.locator(".jp-NotebookPanel-toolbar .jp-Toolbar-item", has_text="Validate").first.click()
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for(timeout=480_000)
    text = dialog.inner_text()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "validate.png"))
    assert "Success" in text and "pass" in text.lower(), text
