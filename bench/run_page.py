"""How many metric keys one MLflow run may hold: what a run of N keys costs ``runs/get``, and whether
MLflow's own run page still opens on it (headless Chromium). Sizes the per-run key budget.

Run:  python -m bench.run_page [--sizes 1000,2500,5000,10000,20000] [--children 200] [--steps 5]
                               [--page-timeout 60] [--no-pages] [--json]
      (~5 min at these defaults on 2 cores; ``--sizes 1000,5000 --children 50`` ~1.5 min)

Setup: one private ``mlflow server`` (testkit.mlflow_server.MlflowServer: sqlite, 127.0.0.1, a free port,
``--workers 1``) for the whole bench; Debian's ``chromium`` and ``chromedriver`` driven by selenium (a
fresh headless browser, 1600x1300, per size and for the experiment check).

Keys, shaped as otel_forge writes them: one node's keys are every MLflow key template of the metric
table (``otel_forge.names.METRICS``; AMD's duplicate NVIDIA's names) rendered, as ``KeyMapper`` names them,
for one typical 8-GPU node (``NODE_SHAPE``: 8 GPUs, 9 NICs, 4 disks, 4 mount points, 8 CPU modes, per-CPU
keys off); about 350 keys (printed as "keys per node"). A run of N keys holds ``TRAIN_KEYS`` (5
``train/``/``eval/`` keys, as a training loop logs them) and N - 5 ``system/node_<n>/<key>`` keys, node
after node (the last node partial). Every key has ``--steps`` steps (default 5, 10 s apart), logged with
``log_batch`` calls of 1,000 metrics (MLflow's per-call limit), in a fresh run per size.

Measured, per size N:

- ``runs/get``: ``GET /api/2.0/mlflow/runs/get`` of the run (the handler the UI's
  ``/ajax-api/2.0/mlflow/runs/get`` calls), one unmeasured call, then 3: the median wall time, the
  server's CPU per call (user + system seconds of the server's process tree, psutil ``cpu_times`` of each
  process with its reaped children, before and after the 3 calls, divided by 3; psutil's resolution is
  10 ms, so small figures are coarse) and the response's size;
- the run page's Overview, ``#/experiments/<exp>/runs/<run>?workflowType=machine_learning``: does it show
  its metrics table ("Metrics (N)") within ``--page-timeout`` s, and when (s from the navigation's start,
  the page's own load included), or "Something went wrong";
- the run page's System metrics tab, ``.../runs/<run>/system-metrics?workflowType=machine_learning``: the
  time to the first chart card with a drawn plotly line (``g.trace.scatter path.js-line``), the cards
  in the DOM and those drawn (after 2 s more), the visible spinners (``.du-bois-light-spin-spinning``
  within the viewport); outcome ``charts`` (a line drawn), ``error`` ("Something went wrong"),
  ``spinners`` (none drawn at the timeout, spinners showing) or ``blank`` (neither); and the chart state
  the tab keeps in the origin's localStorage for the run (the entries naming it, keys and values, in
  UTF-16 characters), its share of Chromium's quota (5,242,880 characters per origin) and how many runs
  of the same size fit in it. MLflow 3.17 writes that state for every run whose tab is opened, never
  evicts it, and does not catch the write that exceeds the quota: that tab shows "Something went
  wrong". A fresh browser fits one run of ~10,000 keys; a user's browser holds the state of every run
  they opened, so a run opens only while its state fits in what is left.

Every probe polls the page (a small script, 4 times a second); while the page's main thread is busy the
poll waits for it, so a page that freezes the browser past the timeout reads as not drawn.

Experiment check (the layout "one child run per node, nested under the job's run"): a fresh experiment
with one parent run (``TRAIN_KEYS``) and ``--children`` C child runs (tag ``mlflow.parentRunId`` = the
parent's id), each holding one node's keys as ``system/<key>`` with ``--steps`` steps. Measured:
``runs/search`` as the experiment page asks it (``{"experiment_ids": [exp], "run_view_type": "ACTIVE_ONLY",
"max_results": 100, "order_by": ["attributes.start_time DESC"]}``: its wall median of 3, server CPU per
call, response size, runs returned); the experiment's runs table (``#/experiments/<exp>/runs``): the time
until it lists a run (the parent's or a child's name), whether the parent's name shows, and the API calls
the page made (Chromium's performance log); whether the parent is in the first 100 runs of
``runs/search`` (the parent starts first, so ``start_time DESC`` puts it after the newest 100 children);
the experiment's chart view (``&compareRunsMode=CHART``): the time to the first drawn line, and the chart
state the page keeps in localStorage (every MLflow entry: the browser is fresh).

The result ends with the ceiling: the largest size whose Overview and System metrics tab both drew within
the timeout in a fresh browser and whose ``runs/get`` answered in under 1 s; and, below it, the budget:
the largest of those sizes whose chart state fits ``RUNS_PER_BROWSER`` (3) times in one browser's quota
(the margin for a user who opens more than one run).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench._common import tree_cpu_s
from otel_forge.mlflow.keys import key_segment, sanitize_key
from otel_forge.names import METRICS
from testkit.mlflow_server import MlflowServer

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
BATCH = 1000  # MLflow's limit of metrics per log_batch call
STEP_MS = 10_000  # a window every 10 s, otel_forge's default interval
TRAINING_VIEW = "workflowType=machine_learning"  # MLflow 3.17's UI: the training view, whatever the browser chose
TRAIN_KEYS = ("train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_second", "eval/loss")
ERROR_TEXT = "Something went wrong"

# One typical 8-GPU training node: the attribute values its keys are rendered with.
NODE_SHAPE: dict[str, tuple[str, ...]] = {
    "cpu.mode": ("user", "system", "idle", "iowait", "nice", "irq", "softirq", "steal"),
    "cpu.logical_number": (),  # per-CPU keys are off by default (OTEL_FORGE_PER_CPU)
    "system.memory.state": ("free", "cached", "buffers"),
    "system.filesystem.mountpoint": ("/", "/dev/shm", "/scratch", "/home"),
    "system.device": ("nvme0n1", "nvme1n1", "nvme2n1", "nvme3n1"),
    "disk.io.direction": ("read", "write"),
    "network.io.direction": ("receive", "transmit"),
    "network.interface.name": ("eth0", *(f"ib{i}" for i in range(8))),
    "hw.id": tuple(str(i) for i in range(8)),
    "otel_forge.gpu.clock": ("sm", "memory"),
    "error.type": ("corrected", "uncorrected"),
    "otel_forge.gpu.link": ("pcie", "nvlink"),
    "otel_forge.gpu.throttle.reason": (
        "gpu_idle",
        "applications_clocks_setting",
        "sw_power_cap",
        "hw_slowdown",
        "sync_boost",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "display_clock_setting",
    ),
}
_PLACEHOLDER = re.compile(r"\{([^}]+)\}")

CARD = '[data-testid="experiment-view-compare-runs-card"]'
# [cards, cards with a drawn line, visible spinners, error shown, marker shown]; textContent needs no layout.
PROBE_JS = f"""
const cards = document.querySelectorAll('{CARD}');
let drawn = 0;
for (const card of cards) if (card.querySelector('g.trace.scatter path.js-line')) drawn++;
const spinners = Array.from(document.querySelectorAll('.du-bois-light-spin-spinning')).filter(el => {{
  const r = el.getBoundingClientRect();
  return r.width > 0 && r.height > 0 && r.bottom > 0 && r.top < window.innerHeight;
}}).length;
const text = document.body ? document.body.textContent : '';
const marker = arguments[0] ? new RegExp(arguments[0]).test(text) : false;
return [cards.length, drawn, spinners, text.includes('{ERROR_TEXT}'), marker];
"""
# Characters (UTF-16 code units, as Chromium counts its quota) of the localStorage entries naming an id.
STORAGE_JS = """
let total = 0;
for (let i = 0; i < localStorage.length; i++) {
  const key = localStorage.key(i);
  if (key.includes(arguments[0])) total += key.length + localStorage.getItem(key).length;
}
return total;
"""
# Chromium's localStorage quota per origin: 10 MiB of UTF-16, keys and values (5,242,880 characters).
# MLflow 3.17 keeps each run's System metrics chart state there, never evicts it, and an over-quota
# write throws (QuotaExceededError): the tab shows "Something went wrong" (mlflow/mlflow PRs #22640 and
# #25167, open, would catch it).
LOCAL_STORAGE_QUOTA_CHARS = 5 * 1024 * 1024
# A run within the budget leaves room in one browser's quota for at least this many runs like it.
RUNS_PER_BROWSER = 3


# --- keys and runs ---------------------------------------------------------------------------------


def node_keys() -> list[str]:
    """The keys one node of ``NODE_SHAPE`` writes, without the ``system/<node>/`` prefix."""
    keys: set[str] = set()
    for spec in METRICS:
        for mlflow_key in spec.mlflow:
            names = _PLACEHOLDER.findall(mlflow_key.key)
            if any(name not in NODE_SHAPE for name in names):
                continue  # an attribute this node shape does not name
            for values in itertools.product(*(NODE_SHAPE[name] for name in names)):
                keys.add(sanitize_key(_render(mlflow_key.key, dict(zip(names, values, strict=True)))))
    return sorted(keys)


def _render(template: str, attributes: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda match: key_segment(attributes[match.group(1)]), template)


def run_keys(n: int) -> list[str]:
    """N keys of one job's run: ``TRAIN_KEYS``, then ``system/node_<i>/<key>`` node after node."""
    per_node = node_keys()
    system = (f"system/node_{i // len(per_node)}/{per_node[i % len(per_node)]}" for i in itertools.count())
    return [*TRAIN_KEYS[:n], *itertools.islice(system, max(0, n - len(TRAIN_KEYS)))]


def fill(client: Any, run_id: str, keys: list[str], steps: int) -> float:
    """Every key at ``steps`` steps, in ``log_batch`` calls of 1,000 metrics; returns the wall seconds."""
    from mlflow.entities import Metric

    started = time.monotonic()
    base_ms = int(time.time() * 1000) - steps * STEP_MS
    metrics = [
        Metric(key, float((i * 7 + step * 13) % 100), base_ms + step * STEP_MS, step)
        for step in range(steps)
        for i, key in enumerate(keys)
    ]
    for start in range(0, len(metrics), BATCH):
        client.log_batch(run_id, metrics=metrics[start : start + BATCH])
    return time.monotonic() - started


# --- the server's answers --------------------------------------------------------------------------


@dataclass
class Call:
    """One REST call, 3 times after one unmeasured: median wall, server CPU per call, response size."""

    wall_ms: float
    server_cpu_ms: float
    response_bytes: int
    body: dict[str, Any] = field(repr=False)


def measure_call(server: MlflowServer, path: str, payload: dict[str, Any] | None = None, repeats: int = 3) -> Call:
    url = f"{server.uri}{path}"
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}

    def call() -> bytes:
        request = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
        with urllib.request.urlopen(request, timeout=300) as response:
            return bytes(response.read())

    call()
    assert server.process is not None
    walls, cpu_before = [], tree_cpu_s(server.process.pid)
    for _ in range(repeats):
        started = time.perf_counter()
        raw = call()
        walls.append(time.perf_counter() - started)
    cpu = tree_cpu_s(server.process.pid) - cpu_before
    return Call(statistics.median(walls) * 1000, cpu / repeats * 1000, len(raw), json.loads(raw))


def get_run(server: MlflowServer, run_id: str) -> Call:
    return measure_call(server, f"/api/2.0/mlflow/runs/get?run_id={run_id}")


def search_runs_as_the_ui_does(server: MlflowServer, experiment_id: str) -> Call:
    payload = {
        "experiment_ids": [experiment_id],
        "run_view_type": "ACTIVE_ONLY",
        "max_results": 100,
        "order_by": ["attributes.start_time DESC"],
    }
    return measure_call(server, "/api/2.0/mlflow/runs/search", payload)


# --- MLflow's UI in headless Chromium ---------------------------------------------------------------


def chromium_available() -> bool:
    return os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)


@contextlib.contextmanager
def chromium(log_requests: bool = False) -> Iterator[Any]:
    """A headless Chromium (the system's, and its driver: selenium never looks one up on the network),
    with a fresh profile (an empty localStorage). ``log_requests``: keep the performance log."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # The console (an error's cause), and with ``log_requests`` the network (the calls a page made).
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", **({"performance": "ALL"} if log_requests else {})})
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1300"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


def ajax_calls(driver: Any) -> dict[str, int]:
    """The MLflow API calls the page made since the last read of the performance log, by path."""
    calls: dict[str, int] = {}
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            path = urllib.parse.urlsplit(message["params"]["request"]["url"]).path
            if path.startswith("/ajax-api/") and "/assistant/" not in path:
                calls[path] = calls.get(path, 0) + 1
    return calls


@dataclass
class Page:
    """What one page showed within the timeout. ``seconds``: from the navigation's start to the first
    drawn line (charts), to the marker (tables), or to the error text. ``storage_chars``: what the page
    keeps in the origin's localStorage under keys naming the run or experiment probed (its charts' UI
    state), in UTF-16 characters, keys included."""

    outcome: str  # charts | shown | error | spinners | blank
    seconds: float | None
    cards: int = 0
    drawn: int = 0
    spinners: int = 0
    marker: bool = False
    storage_chars: int | None = None
    cause: str | None = None  # an error's, from the console: "localStorage quota" or its first SEVERE line


def _error_cause(driver: Any) -> str | None:
    from selenium.common.exceptions import WebDriverException

    try:
        severe = [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    except WebDriverException:
        return None
    if any("QuotaExceededError" in message for message in severe):
        return "localStorage quota"
    return next((message[:300] for message in severe if "Failed to load resource" not in message), None)


def probe(
    driver: Any, url: str, timeout_s: float, marker: str | None = None, storage_id: str = "", settle_s: float = 2.0
) -> Page:
    """Open ``url`` from a blank page and poll it until a line is drawn (or, with ``marker``, a regex,
    until the page's text matches it), the error text shows, or ``timeout_s`` passes."""
    from selenium.common.exceptions import WebDriverException

    def page(outcome: str, seconds: float | None, state: list[Any]) -> Page:
        storage = None
        if storage_id:
            with contextlib.suppress(WebDriverException):
                storage = int(driver.execute_script(STORAGE_JS, storage_id))
        cards, drawn, spinners, _, shown = state
        cause = _error_cause(driver) if outcome == "error" else None
        return Page(outcome, seconds, cards, drawn, spinners, bool(shown), storage, cause)

    driver.get("about:blank")
    with contextlib.suppress(WebDriverException):
        driver.get_log("browser")  # what earlier pages logged
    driver.set_script_timeout(max(1.0, timeout_s))
    started = time.monotonic()
    last = [0, 0, 0, False, False]
    with contextlib.suppress(WebDriverException):  # a load past the driver's timeout: the polls tell
        driver.get(url)
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        try:
            last = driver.execute_script(PROBE_JS, marker or "")
        except WebDriverException:
            continue  # the page's main thread stayed busy past the script timeout
        error, shown, drawn = last[3], last[4], last[1]
        if error or (shown if marker else drawn > 0):
            seconds = time.monotonic() - started
            if error:
                return page("error", seconds, last)
            if not marker:
                time.sleep(settle_s)  # the charts in view finish drawing, their state is saved
                with contextlib.suppress(WebDriverException):
                    last = driver.execute_script(PROBE_JS, "")
            return page("shown" if marker else "charts", seconds, last)
        time.sleep(0.25)
    return page("spinners" if last[2] else "blank", None, last)


def run_page_url(server: MlflowServer, experiment_id: str, run_id: str, tab: str = "") -> str:
    return f"{server.uri}/#/experiments/{experiment_id}/runs/{run_id}{tab}?{TRAINING_VIEW}"


def probe_overview(
    driver: Any, server: MlflowServer, experiment_id: str, run_id: str, keys: int, timeout_s: float
) -> Page:
    return probe(driver, run_page_url(server, experiment_id, run_id), timeout_s, marker=rf"Metrics\s*\(\s*{keys}\s*\)")


def probe_system_metrics(driver: Any, server: MlflowServer, experiment_id: str, run_id: str, timeout_s: float) -> Page:
    return probe(driver, run_page_url(server, experiment_id, run_id, "/system-metrics"), timeout_s, storage_id=run_id)


# --- the measurements -------------------------------------------------------------------------------


def measure_size(client: Any, server: MlflowServer, n: int, args: argparse.Namespace) -> dict[str, Any]:
    experiment_id = client.create_experiment(f"run-page-{n}-{time.time_ns()}")
    run_id = client.create_run(experiment_id, run_name=f"keys-{n}").info.run_id
    keys = run_keys(n)
    fill_s = fill(client, run_id, keys, args.steps)
    got = get_run(server, run_id)
    assert len(got.body["run"]["data"]["metrics"]) == n, "runs/get did not return every key"
    row: dict[str, Any] = {
        "keys": n,
        "nodes": -(-(n - len(TRAIN_KEYS)) // len(node_keys())),
        "fill_s": fill_s,
        "get_wall_ms": got.wall_ms,
        "get_server_cpu_ms": got.server_cpu_ms,
        "get_response_bytes": got.response_bytes,
    }
    if args.pages:
        with chromium() as driver:
            timeout_s = args.page_timeout
            row["overview"] = asdict(probe_overview(driver, server, experiment_id, run_id, n, timeout_s))
            row["system_metrics"] = asdict(probe_system_metrics(driver, server, experiment_id, run_id, timeout_s))
    return row


def measure_children(client: Any, server: MlflowServer, children: int, args: argparse.Namespace) -> dict[str, Any]:
    experiment_id = client.create_experiment(f"run-page-children-{children}-{time.time_ns()}")
    parent = client.create_run(experiment_id, run_name="job-parent").info.run_id
    started = time.monotonic()
    fill(client, parent, list(TRAIN_KEYS), args.steps)
    child_keys = [f"system/{key}" for key in node_keys()]
    for i in range(children):
        child = client.create_run(experiment_id, run_name=f"node_{i}", tags={"mlflow.parentRunId": parent})
        fill(client, child.info.run_id, child_keys, args.steps)
    fill_s = time.monotonic() - started
    searched = search_runs_as_the_ui_does(server, experiment_id)
    runs = searched.body.get("runs", [])
    row: dict[str, Any] = {
        "children": children,
        "keys_per_child": len(child_keys),
        "fill_s": fill_s,
        "search_wall_ms": searched.wall_ms,
        "search_server_cpu_ms": searched.server_cpu_ms,
        "search_response_bytes": searched.response_bytes,
        "search_runs": len(runs),
        "parent_in_first_page": any(run["info"]["run_id"] == parent for run in runs),
    }
    if args.pages:
        runs_url = f"{server.uri}/#/experiments/{experiment_id}/runs?{TRAINING_VIEW}"
        with chromium(log_requests=True) as driver:
            table = probe(driver, runs_url, args.page_timeout, marker=r"job-parent|node_\d")
            text = "" if table.outcome != "shown" else driver.execute_script("return document.body.textContent")
            time.sleep(2)  # the calls that follow the first rows
            row["table"] = {**asdict(table), "parent_shown": "job-parent" in text, "calls": ajax_calls(driver)}
            charts = probe(
                driver, f"{runs_url}&compareRunsMode=CHART", args.page_timeout, storage_id="MLflowLocalStorage"
            )
            row["charts"] = asdict(charts)
    return row


def ceiling(rows: list[dict[str, Any]], runs_per_browser: int = 1) -> int | None:
    """The largest size whose Overview and System metrics tab drew, whose runs/get took under 1 s, and
    whose chart state leaves room in one browser's localStorage for ``runs_per_browser`` runs like it."""
    good = []
    for row in rows:
        overview, system = row.get("overview", {"outcome": "shown"}), row.get("system_metrics", {"outcome": "charts"})
        state = system.get("storage_chars") or 0
        if (
            row["get_wall_ms"] < 1000
            and overview["outcome"] == "shown"
            and system["outcome"] == "charts"
            and state * runs_per_browser <= LOCAL_STORAGE_QUOTA_CHARS
        ):
            good.append(row["keys"])
    return max(good, default=None)


# --- output ----------------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _page(page: dict[str, Any] | None, charts: bool = True) -> str:
    if page is None:
        return "not run"
    when = f" {page['seconds']:.1f} s" if page["seconds"] is not None else ""
    extra = f" ({page['drawn']}/{page['cards']} cards drawn)" if charts and page["outcome"] == "charts" else ""
    if page["outcome"] == "spinners":
        extra = f" ({page['spinners']} spinners, {page['cards']} cards)"
    if page["outcome"] == "error" and page.get("cause"):
        extra = f" ({page['cause']})"
    return f"{page['outcome']}{when}{extra}"


def _state(page: dict[str, Any] | None) -> str:
    """A page's chart state in localStorage: characters, share of Chromium's quota, how many such fit."""
    chars = (page or {}).get("storage_chars")
    if not chars or (page or {}).get("outcome") != "charts":
        return "-"
    size = f"{chars / 1e6:.2f} M" if chars >= 100_000 else f"{chars / 1e3:.1f} K"
    return f"{size} ({chars / LOCAL_STORAGE_QUOTA_CHARS:.0%}; {LOCAL_STORAGE_QUOTA_CHARS // chars} fit)"


def render_markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    lines = [
        f"`{result['command']}`: {result['keys_per_node']} keys per node, {settings['steps']} steps per key, "
        f"page timeout {settings['page_timeout']:.0f} s; MLflow {result['machine']['mlflow']}, "
        f"{result['machine']['cpus']} CPUs; {result['total_s']:.0f} s in all.",
        "",
        "| keys | nodes | fill s | runs/get wall ms | runs/get server CPU ms | response MB | Overview "
        "| System metrics | its chart state in localStorage (share of quota; runs that fit) |",
        "|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for row in result["sizes"]:
        system = row.get("system_metrics")
        lines.append(
            f"| {row['keys']:,} | {row['nodes']} | {row['fill_s']:.1f} | {_num(row['get_wall_ms'])} "
            f"| {_num(row['get_server_cpu_ms'])} | {row['get_response_bytes'] / 1e6:.2f} "
            f"| {_page(row.get('overview'), charts=False)} | {_page(system)} | {_state(system)} |"
        )
    if child := result.get("children"):
        table = child.get("table") or {}
        searches = sum(n for path, n in table.get("calls", {}).items() if path.endswith("/runs/search"))
        parent = "yes" if table.get("parent_shown") else "no"
        lines += [
            "",
            "| child runs | keys per child | fill s | runs/search wall ms | server CPU ms | response MB "
            "| runs | parent in them | runs table (parent shown; the page's runs/search calls) | chart view "
            "| its chart state |",
            "|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|",
            f"| {child['children']} | {child['keys_per_child']} | {child['fill_s']:.1f} "
            f"| {_num(child['search_wall_ms'])} | {_num(child['search_server_cpu_ms'])} "
            f"| {child['search_response_bytes'] / 1e6:.2f} | {child['search_runs']} "
            f"| {'yes' if child['parent_in_first_page'] else 'no'} "
            f"| {_page(child.get('table'), charts=False)} ({parent}; {searches}) "
            f"| {_page(child.get('charts'))} | {_state(child.get('charts'))} |",
        ]
    lines += [
        "",
        f"Largest size that opened in a fresh browser, runs/get under 1 s: {_num(result['ceiling'])} keys; "
        f"of those, the largest whose chart state fits {RUNS_PER_BROWSER} times in one browser's quota: "
        f"{_num(result['budget'])} keys.",
    ]
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=_sizes, default=[1000, 2500, 5000, 10000, 20000], help="keys per run, comma-separated"
    )
    parser.add_argument("--children", type=int, default=200, help="child runs of the experiment check (0: skip it)")
    parser.add_argument("--steps", type=int, default=5, help="steps per key (default 5)")
    parser.add_argument("--page-timeout", type=float, default=60.0, help="seconds a page gets to draw (default 60)")
    parser.add_argument(
        "--pages", action=argparse.BooleanOptionalAction, default=True, help="open the pages in Chromium (default: yes)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    return parser.parse_args(argv)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ["-m", "bench.run_page", *sys.argv[1:]])
    # SIGTERM and Ctrl-C unwind through every finally, which stops the server and the browser.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.pages and not chromium_available():
        _progress(f"note: {CHROMIUM} or {CHROMEDRIVER} missing: pages not opened (--no-pages)")
        args.pages = False
    import mlflow
    from mlflow import MlflowClient

    started = time.monotonic()
    sizes: list[dict[str, Any]] = []
    children: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="run-page-") as directory, MlflowServer(Path(directory)) as server:
        client = MlflowClient(server.uri)
        for n in args.sizes:
            sizes.append(measure_size(client, server, n, args))
            _progress(f"{n} keys: {json.dumps(sizes[-1])}")
        if args.children:
            children = measure_children(client, server, args.children, args)
            _progress(f"{args.children} children: {json.dumps(children)}")
    result = {
        "command": command,
        "keys_per_node": len(node_keys()),
        "total_s": time.monotonic() - started,
        "settings": {name: getattr(args, name) for name in ("sizes", "children", "steps", "page_timeout", "pages")},
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mlflow": mlflow.__version__,
        },
        "sizes": sizes,
        "children": children,
        "ceiling": ceiling(sizes),
        "budget": ceiling(sizes, RUNS_PER_BROWSER),
    }
    print(json.dumps(result, indent=2) if args.json else render_markdown(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
