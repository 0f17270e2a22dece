"""What a person sees, checked in a real browser: headless Chromium (Debian's package, not
Playwright's own download) driven by Playwright's Python package.

- JupyterLab: a cheap notebook (20_matmul with the tiny parameters its papermill test uses) is
  opened in JupyterLab started as `labkit lab` starts it (127.0.0.1, a token), run with
  Run > Run All Cells; the widget panel and the plotly figures render; a click on the panel's Run
  makes the panel's figure gain points, and no chart's legend covers its plot area or title.
  The page is saved as a screenshot (on failure too).
- The report: the page `labkit report` wrote for that notebook in the shared report (conftest's
  `report`) is opened from disk with every request that is not a local file aborted (and
  recorded: none may be attempted); each plotly output of the executed notebook is a rendered
  chart (`div.js-plotly-plot` with `svg.main-svg`) whose legend stays off its plot area.

Screenshots go to `test-artifacts/browser/` at the repository root (ignored by git).
Skipped only where no browser can be had: no `playwright` package, or no Chromium binary
(`$LABKIT_CHROMIUM`, then `chromium` on PATH, then /usr/bin/chromium).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from labkit.cli import lab_command

from conftest import PARAMETERS, needs

# Slow on purpose (a server, a kernel and a browser; about 30 s each here): the waits below fail
# first, with what the page showed, well inside the suite's limit (pytest-timeout's 600 s, which
# also bounds the report fixture's setup when a test here is the first to ask for it).
pytestmark = [pytest.mark.slow, needs("playwright", "papermill")]

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts" / "browser"
NOTEBOOK = "20_matmul.ipynb"  # cheap: a few 128x128 matmuls per variant
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# How long each stage may take on the reference CPU; a wait is that times this CPU's measured
# slowdown (`scaled`): a bound on a slow CPU's time, not a speed to meet (under a 0.4-core quota
# the panel's first point took over 60 s)
SERVER_START_S, NOTEBOOK_RUN_S, PANEL_RUN_S = 60, 120, 60
KERNEL_DIALOG = ".jp-Dialog .jp-mod-accept"  # "Select Kernel", when JupyterLab asks


def scaled(seconds: float) -> float:
    from labkit.measure.pace import measure_pace

    return seconds * max(1.0, measure_pace().slowdown)


# Charts drawn: plotly's graph divs that hold an svg (each has more than one svg.main-svg layer).
DRAWN_JS = ("() => [...document.querySelectorAll('div.js-plotly-plot')]"
            ".filter(gd => gd.querySelector('svg.main-svg')).length")
# Each plotly chart inside the output that holds the panel's Run button ([comparison figure,
# device monitor]): its title, its traces and their points (x values over all traces); null
# before the panel exists. PANEL_POINTS_JS: the points alone.
PANEL_CHARTS_JS = """() => {
  const run = [...document.querySelectorAll('.jp-OutputArea-output button')]
    .find(b => b.textContent.trim() === 'Run');
  if (!run) return null;
  return [...run.closest('.jp-OutputArea-output').querySelectorAll('.js-plotly-plot')].map(gd => ({
    title: gd.layout?.title?.text ?? null, traces: (gd.data || []).length,
    points: (gd.data || []).reduce((n, t) => n + (t.x ? t.x.length : 0), 0)}));
}"""
PANEL_POINTS_JS = f"() => ({PANEL_CHARTS_JS})()?.map(chart => chart.points) ?? null"
# Every drawn chart's legend box against its plot areas (plotly's drag rectangles, one per
# subplot) and its title: {legends: how many charts had a legend, overlaps: [[chart, what], ...]}.
LEGEND_CLEAR_JS = """() => {
  const hit = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  const charts = [...document.querySelectorAll('div.js-plotly-plot')];
  const overlaps = [], legends = charts.filter(gd => gd.querySelector('g.legend'));
  legends.forEach(gd => {
    const legend = gd.querySelector('g.legend').getBoundingClientRect();
    const parts = [...gd.querySelectorAll('.nsewdrag')].map(e => ['plot area', e]);
    const title = gd.querySelector('.g-gtitle text');
    if (title) parts.push(['title', title]);
    parts.filter(([, e]) => hit(legend, e.getBoundingClientRect()))
      .forEach(([what]) => overlaps.push([charts.indexOf(gd), what]));
  });
  return {legends: legends.length, overlaps};
}"""


def find_chromium() -> str | None:
    """$LABKIT_CHROMIUM when set (trusted: a wrong path fails at launch), else Debian's binary."""
    if os.environ.get("LABKIT_CHROMIUM"):
        return os.environ["LABKIT_CHROMIUM"]
    found = shutil.which("chromium") or "/usr/bin/chromium"
    return found if os.access(found, os.X_OK) else None


@pytest.fixture(scope="module")
def browser():
    executable = find_chromium()
    if executable is None:
        pytest.skip("no Chromium: install Debian's `chromium` or set LABKIT_CHROMIUM to a binary")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def offline_page(browser, allowed: tuple[str, ...], viewport=(1400, 1000)):
    """A new page on which any request outside `allowed` URL prefixes is aborted and recorded in
    the returned list; JavaScript errors on the page are recorded in the second list."""
    page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
    refused, errors = [], []

    def guard(route):
        if route.request.url.startswith(allowed + ("data:", "blob:")):
            route.continue_()
        else:
            refused.append(route.request.url)
            route.abort()

    page.route("**/*", guard)
    page.on("pageerror", lambda e: errors.append(str(e)))
    # console errors are only reported with a failed wait (JupyterLab logs some of its own)
    page.console_errors = []
    page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text[:300]))
    return page, refused, errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_notebook(root: Path) -> None:
    """The notebook with its tiny parameters injected by papermill (as a report run does), storing
    its runs under `root`."""
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    parameters = {"overrides": PARAMETERS[Path(NOTEBOOK).stem]["overrides"], "device": "cpu",
                  "runs_dir": str(root / "runs")}
    nb = parameterize_notebook(load_notebook_node(str(REPO / "notebooks" / NOTEBOOK)),
                               parameters)
    (root / NOTEBOOK).write_text(json.dumps(nb, indent=1))


def quiet_lab_settings(folder: Path) -> None:
    """User settings of our own: no news or update toasts over the page (nor requests for them)."""
    notes = folder / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notes.parent.mkdir(parents=True)
    notes.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))


def wait_until_serving(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + scaled(SERVER_START_S)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"JupyterLab did not answer in {scaled(SERVER_START_S):.0f} s:\n"
                f"{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab (the `labkit lab` command) serving a folder with the prepared notebook; yields its
    base URL and token. The process group is ended afterwards, also when a test failed."""
    tmp_path = tmp_path_factory.mktemp("jupyterlab")
    root = tmp_path / "lab"
    root.mkdir()
    prepare_notebook(root)
    quiet_lab_settings(tmp_path / "settings")
    port, token = free_port(), "labkit-browser-test"
    cmd, env = lab_command(port, token, root_dir=root)  # `labkit lab`'s command, on our folder
    cmd.append("--no-browser")
    env.update(JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    log = tmp_path / "lab.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_serving(proc, f"{base}/api/status?token={token}", log)
        yield base, token
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it shuts its kernels down), SIGKILL if it hangs."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def accept_kernel_dialog(page) -> None:
    """JupyterLab may ask which kernel to start; the notebook's own (python3) is preselected."""
    dialog = page.locator(KERNEL_DIALOG)
    if dialog.count():
        dialog.click()


def screenshot(page, name: str, full_page: bool = False) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


def test_notebook_panel_in_jupyterlab_gains_points_on_run(browser, lab):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect

    base, token = lab
    page, refused, errors = offline_page(browser, (base,))
    try:
        page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}")
        page.locator(".jp-Notebook").wait_for(timeout=1000 * scaled(SERVER_START_S))
        page.locator('.jp-StatusBar-TextItem:has-text("Idle")').wait_for(
            timeout=1000 * scaled(SERVER_START_S))
        accept_kernel_dialog(page)
        page.click('.lm-MenuBar-itemLabel:text-is("Run")')
        page.click('.lm-Menu-itemLabel:text-is("Run All Cells")')
        run = page.locator('.jp-OutputArea-output button:has-text("Run")')
        run.or_(page.locator(KERNEL_DIALOG)).first.wait_for(timeout=1000 * scaled(NOTEBOOK_RUN_S))
        accept_kernel_dialog(page)
        run.wait_for(timeout=1000 * scaled(NOTEBOOK_RUN_S))
        run.scroll_into_view_if_needed()
        # the panel's comparison figure and device monitor are drawn, empty until Run
        page.wait_for_function(f"() => ({PANEL_POINTS_JS})()?.length === 2")
        before = page.evaluate(PANEL_POINTS_JS)
        run.click()
        try:
            page.wait_for_function(f"() => ({PANEL_POINTS_JS})()[0] > {before[0]}",
                                   timeout=1000 * scaled(PANEL_RUN_S))
        except PlaywrightTimeout:  # what the page held (at 5x, FigureWidget charts once stayed
            # without even their initial title: the panel now sends its figures as plotly JSON)
            pytest.fail(f"no point drawn; the panel's charts: {page.evaluate(PANEL_CHARTS_JS)}; "
                        f"page errors: {errors}; console errors: {page.console_errors}; "
                        f"refused: {refused}")
        page.locator('.jp-OutputArea-output:has-text("done:")').wait_for(
            timeout=1000 * scaled(PANEL_RUN_S))
        assert page.evaluate(DRAWN_JS) >= 3  # the panel's two and the static comparison figure
        # the button comes back once the last draw and the tables are in (just after "done:")
        expect(run).to_be_enabled(timeout=1000 * scaled(PANEL_RUN_S))
        legends = page.evaluate(LEGEND_CLEAR_JS)
    finally:
        screenshot(page, Path(NOTEBOOK).stem)
        page.close()
    # the panel's figure and the static comparison figure, at the panel's default width
    assert legends["legends"] >= 2 and not legends["overlaps"], legends
    assert not errors, errors
    assert not refused, f"JupyterLab asked for non-local addresses: {refused}"


def test_lab_answers_with_its_token_and_refuses_a_request_without_it(lab):
    """The server `labkit lab`'s command starts (its 127.0.0.1-only command line: test_cli.py)."""
    import urllib.error

    base, token = lab
    url = f"{base}/api/contents/{NOTEBOOK}?content=0"
    with urllib.request.urlopen(f"{url}&token={token}", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["name"] == NOTEBOOK
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=5)
    assert refused.value.code == 403


def test_report_page_renders_its_plots_with_the_network_blocked(browser, report):
    """The page of the shared report (conftest's `report`: every notebook, as `labkit report`
    writes them) for the notebook the JupyterLab test runs."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    out, stem = report.out, Path(NOTEBOOK).stem
    assert (out / "plotly.min.js").is_file() and (out / "index.html").is_file()
    executed = json.loads((out / f"{stem}.ipynb").read_text())
    num_plots = sum("application/vnd.plotly.v1+json" in o.get("data", {})
                    for c in executed["cells"] for o in c.get("outputs", []))
    assert num_plots >= 1
    page, refused, errors = offline_page(browser, ("file://",))
    try:
        page.goto((out / f"{stem}.html").as_uri())
        try:
            page.wait_for_function(f"() => ({DRAWN_JS})() >= {num_plots}")
        except PlaywrightTimeout:
            pytest.fail(f"{num_plots} plots not drawn; refused requests: {refused}; errors: {errors}")
        traces = page.evaluate("() => [...document.querySelectorAll('div.js-plotly-plot')]"
                               ".map(gd => gd.data.length)")
        legends = page.evaluate(LEGEND_CLEAR_JS)
    finally:
        screenshot(page, f"report_{stem}", full_page=True)
        page.close()
    assert len(traces) == num_plots and all(n > 0 for n in traces), traces
    assert legends["legends"] >= 1 and not legends["overlaps"], legends
    assert not refused, f"the page asked for network addresses: {refused}"
    assert not errors, errors
