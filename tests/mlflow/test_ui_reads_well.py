"""The MLflow UI reads well (issue 23): a run as a user makes it, ``otel-forge run -- python
examples/train_with_trainingrun.py --steps 200`` against the session's real ``mlflow server``, read
back through MLflow's API and rendered by MLflow's own UI in headless Chromium (selenium, the system's
``chromium`` and ``chromedriver``):

- every ``system/`` key is a line: its first window and its last (the run's, but for CMD's
  ``process_`` keys) are both sent;
- the 8 checkpoints the example registers are the run's outputs: its "Logged models";
- the experiment otel-forge creates is of training runs (``mlflow.experimentKind``);
- the run's System metrics tab draws a line chart per key, none a bar; the Overview lists the models.

``OTEL_FORGE_DOCS_SCREENSHOT=1`` also writes the screenshot to docs/images/mlflow-run.png (README).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from run_reading import anchor_steps

from bench.run_page import CHROMEDRIVER, CHROMIUM, chromium, chromium_available
from otel_forge.mlflow.system_metrics.windows import ChangedValues, Window
from testkit.hermetic import hermetic_environ

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS_SCREENSHOT = REPO_ROOT / "docs" / "images" / "mlflow-run.png"
# Read at import: the hermetic fixture clears every OTEL_* variable before a test runs.
WRITE_DOCS_SCREENSHOT = os.environ.get("OTEL_FORGE_DOCS_SCREENSHOT") == "1"
CHECKPOINTS = 8  # the example registers one every 25 steps
# MLflow 3.17's UI opens an experiment by its GenAI / Model training switch (kept in the browser);
# a link that names the training view opens it whatever the browser chose.
TRAINING_VIEW = "workflowType=machine_learning"
CARD = '[data-testid="experiment-view-compare-runs-card"]'
# Per chart card: its title, its plotly line traces, its bar traces (a single point draws a bar).
CARDS_JS = f"""
return Array.from(document.querySelectorAll('{CARD}')).map(card => [
  card.innerText.split('\\n')[0],
  card.querySelectorAll('g.trace.scatter path.js-line').length,
  card.querySelectorAll('g.trace.bars').length,
]);
"""


# --- the last window is sent whole -----------------------------------------------------------------


def test_the_close_sends_every_value_the_last_window_held_back_at_its_step() -> None:
    changed = ChangedValues(refresh_windows=10)
    values = (("a_anchor", 1.0), ("b_total", 64.0), ("c_util", 5.0))
    assert changed.keep(Window(0, 1000, values)).values == values  # the first window: whole
    assert changed.keep(Window(1, 2000, values)).values == (("a_anchor", 1.0),)  # a middle one: changes only
    # The periodic reader closed the last window; the close sends what it held back, at its step.
    assert changed.close(None) == Window(1, 2000, (("b_total", 64.0), ("c_util", 5.0)))
    assert changed.close(None) is None  # nothing twice


def test_a_key_that_ends_sends_what_it_held_back_at_its_last_step() -> None:
    changed = ChangedValues(refresh_windows=10)
    with_process = (("a_anchor", 1.0), ("process_count", 1.0))
    changed.keep(Window(0, 1000, with_process))
    changed.keep(Window(1, 2000, with_process))  # process_count held back
    after = Window(2, 3000, (("a_anchor", 1.0),))  # the command exited
    assert changed.ended(after) == Window(1, 2000, (("process_count", 1.0),))
    assert changed.keep(after).values == (("a_anchor", 1.0),)
    assert changed.ended(Window(3, 4000, (("a_anchor", 1.0),))) is None


def test_a_window_the_close_completes_is_sent_whole() -> None:
    changed = ChangedValues(refresh_windows=10)
    values = (("a_anchor", 1.0), ("b_total", 64.0))
    changed.keep(Window(0, 1000, values))
    assert changed.close(Window(1, 2000, values)) == Window(1, 2000, values)
    assert ChangedValues(refresh_windows=10).close(None) is None  # no window ever: nothing


# --- a run as a user makes it ---------------------------------------------------------------------


@dataclass
class UserRun:
    run_id: str
    experiment_id: str
    workdir: Path


@pytest.fixture(scope="module")
def user_run(mlflow_server, tmp_path_factory) -> UserRun:  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    work = tmp_path_factory.mktemp("ui-run")
    experiment = f"ui-{uuid.uuid4().hex[:8]}"
    env = hermetic_environ(
        {"OTEL_FORGE_SPOOL_DIR": str(work / "spool"), "TMPDIR": str(work)},
        prefixes=("OTEL_", "MLFLOW_"),
        MLFLOW_TRACKING_URI=mlflow_server.uri,
    )
    result = subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", "run", "--no-prometheus", "--interval", "0.3"]
        # CMD stays a few windows (its Python, which imports no MLflow, is done within one): the process
        # keys then make lines from CMD's start to its end.
        + ["--experiment", experiment, "--", "sh", "-c", '"$@" && sleep 1.2', "sh", sys.executable]
        + [str(REPO_ROOT / "examples/train_with_trainingrun.py"), "--steps", "200"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    experiment_id = MlflowClient(mlflow_server.uri).get_experiment_by_name(experiment).experiment_id
    (run,) = MlflowClient(mlflow_server.uri).search_runs([experiment_id])
    return UserRun(run.info.run_id, experiment_id, work)


def system_keys(client: Any, run_id: str) -> list[str]:
    return sorted(key for key in client.get_run(run_id).data.metrics if key.startswith("system/"))


def test_every_system_key_is_a_line_from_its_first_window_to_the_last(user_run, client) -> None:
    windows = anchor_steps(client, user_run.run_id)
    assert len(windows) >= 3, windows  # several windows, so a middle one withholds what did not change
    keys = system_keys(client, user_run.run_id)
    assert len(keys) >= 20, keys
    lone = {}
    for key in keys:
        steps = sorted(m.step for m in client.get_metric_history(user_run.run_id, key))
        # A rate needs two samples: its first value is the second window's. The process_ keys are
        # CMD's, which starts after the agent and exits before it: they begin and end with CMD; a
        # rank's progress keys begin with its first step (this script's 200 steps take a moment: they
        # may all fall in the last window, one point).
        process = key.startswith(("system/process_", "system/training_rank_"))
        late = steps[0] > windows[0] + 1 and not process
        lone_rank = key.startswith("system/training_rank_") and steps == [windows[-1]]
        if (len(steps) < 2 and not lone_rank) or late or (steps[-1] != windows[-1] and not process):
            lone[key] = steps
    assert lone == {}, f"windows {windows}; keys without their first and last window: {lone}"


def test_the_checkpoints_are_the_runs_logged_models(user_run, client) -> None:
    run = client.get_run(user_run.run_id)
    models = client.search_logged_models(experiment_ids=[user_run.experiment_id])
    registered = {m.model_id: m for m in models if m.source_run_id == user_run.run_id}
    assert len(registered) == CHECKPOINTS
    outputs = {output.model_id: output.step for output in run.outputs.model_outputs}
    assert outputs == {model_id: int(m.tags["otel_forge.checkpoint.step"]) for model_id, m in registered.items()}


def test_the_experiment_otel_forge_creates_is_of_training_runs(user_run, client) -> None:
    tags = client.get_experiment(user_run.experiment_id).tags
    assert tags.get("mlflow.experimentKind") == "custom_model_development"


# --- MLflow's UI, in headless Chromium -------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not chromium_available():
        pytest.skip(f"{CHROMIUM} or {CHROMEDRIVER} missing (Debian: apt-get install chromium chromium-driver)")
    pytest.importorskip("selenium.webdriver")
    with chromium() as driver:
        yield driver


def wait_until(condition: Any, timeout_s: float = 60.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)
    return value


def chart_kinds(driver: Any, expected: set[str]) -> dict[str, tuple[int, int]]:
    """(line traces, bar traces) per chart title: the grid draws only the cards in view, so it is
    scrolled card by card, in order, until every expected chart has drawn."""
    from selenium.webdriver.common.by import By

    drawn: dict[str, tuple[int, int]] = {}
    deadline = time.monotonic() + 90
    while not expected <= drawn.keys() and time.monotonic() < deadline:
        drawn.update({title: (lines, bars) for title, lines, bars in driver.execute_script(CARDS_JS) if lines or bars})
        if cards := driver.find_elements(By.CSS_SELECTOR, CARD):
            # The first card not drawn yet into view, else the last one (the grid adds those below).
            undrawn = [card for card in cards if card.text.split("\n")[0] not in drawn]
            driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", (undrawn or cards[-1:])[0])
        time.sleep(0.3)
    return drawn


def test_the_run_page_draws_lines_and_lists_the_logged_models(user_run, client, mlflow_server, browser) -> None:
    from selenium.webdriver.common.by import By

    run_page = f"{mlflow_server.uri}/#/experiments/{user_run.experiment_id}/runs/{user_run.run_id}"
    expected = {key.removeprefix("system/") for key in system_keys(client, user_run.run_id)}

    browser.get(f"{run_page}/system-metrics?{TRAINING_VIEW}")
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, CARD), what="the system metrics charts")
    drawn = chart_kinds(browser, expected)
    assert drawn.keys() == expected, expected ^ drawn.keys()
    not_lines = {title: kinds for title, kinds in drawn.items() if kinds[0] == 0 or kinds[1] != 0}
    assert not_lines == {}, f"(lines, bars) of the charts that are not lines: {not_lines}"

    browser.get(f"{run_page}?{TRAINING_VIEW}")
    names = {m.name for m in client.search_logged_models(experiment_ids=[user_run.experiment_id])}

    def body_with_models() -> str:
        text = browser.find_element(By.TAG_NAME, "body").text
        return text if f"Logged models ({CHECKPOINTS})" in text else ""

    body = wait_until(body_with_models, what="the Overview's logged models")
    assert names and all(name in body for name in names), (names, body)

    # The experiment, by the same link, opens on its training runs, this run among them.
    browser.get(f"{mlflow_server.uri}/#/experiments/{user_run.experiment_id}?{TRAINING_VIEW}")
    wait_until(lambda: "/runs?" in browser.current_url, what="the runs view")
    wait_until(lambda: "example-trainingrun" in browser.find_element(By.TAG_NAME, "body").text, what="the run")


def test_a_screenshot_of_the_runs_charts(user_run, mlflow_server, browser) -> None:
    """The run's loss beside its system charts (the experiment's chart view: the run page keeps model
    and system metrics on separate tabs), for the README."""
    from selenium.webdriver.common.by import By

    browser.get(
        f"{mlflow_server.uri}/#/experiments/{user_run.experiment_id}/runs?{TRAINING_VIEW}&compareRunsMode=CHART"
    )
    search = wait_until(
        lambda: browser.find_elements(By.CSS_SELECTOR, 'input[placeholder="Search metric charts"]'), what="the charts"
    )[0]
    for close in browser.find_elements(By.CSS_SELECTOR, '[data-component-id="mlflow.assistant.chat_panel.close"]'):
        close.click()  # the assistant's panel, open by default, would hide half the charts
    search.send_keys("loss|cpu_utilization|process_cpu|system_memory_usage_megabytes|network_receive_megabytes_per")
    wait_until(lambda: len(browser.execute_script(CARDS_JS)) >= 4, what="the searched charts")
    time.sleep(2)  # the charts' first draw
    shot = user_run.workdir / "mlflow-run.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if WRITE_DOCS_SCREENSHOT:
        DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, DOCS_SCREENSHOT)
