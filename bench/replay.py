"""``otel-forge replay`` of a journal left behind, against MLflow's own ``log_batch`` at the same server.

Run:  python -m bench.replay --values 1000000 [--keys 10] [--json]

1. The journal, made for real: a child ``sys.executable`` runs ``TrainingRun(tracking_uri=<a port
   nothing listens on>, system_metrics=False)`` with ``OTEL_FORGE_SPOOL_DIR`` set to the bench's
   spool, logs ``--keys`` keys at every step (``--values / --keys`` steps, each key's value a
   function of its step), closes the run and exits. The run never opened: its values and its end
   (FINISHED) stay in the journal, and its companion gives the journal up once the server refuses
   it. The bench waits for the journal's lock to be free and checks that it holds every value.
2. A private ``mlflow server`` (``testkit.mlflow_server.MlflowServer``: sqlite, 127.0.0.1, one
   worker, its job runner off) behind a counting proxy (``testkit.proxy.MlflowProxy`` that counts
   requests by path and keeps no bodies): both subjects talk to the proxy.
3. Subjects, one after the other (``--order``, default ``anchor replay anchor``: the anchors bracket
   the replay, as the server's sqlite tables grow by every subject's values), each into a fresh run
   of the same server:

   - ``anchor``: MLflow's own ``MlflowClient().log_batch`` from one thread of the bench's process,
     the same values in the same order (step by step, every key) in batches of ``--batch`` (1,000,
     MLflow's limit and what a replay sends): the server's pace, the floor of any delivery. Timed from
     its first call to its last answer (the run made before); its client's CPU is the thread's.
   - ``replay``: ``otel-forge replay --all --tracking-uri PROXY`` (``python -m otel_forge.cli``, the
     console script's module) with ``OTEL_FORGE_SPOOL_DIR`` set: timed from its start to its exit
     (``wall``: Python's start, imports, the count of what the journal keeps, the run opened from the
     journal's plan, every value, the run's end), and from its first ``log-batch`` request to its last
     answer at the proxy (``delivering``). Its process tree's RSS is sampled every 50 ms (psutil), its
     CPU is its rusage once reaped.

   The ratio is the replay's values/s over the anchor's (1.0: the server's pace).
4. What each run holds afterwards: ``--history-keys`` keys' whole histories read back (every step
   once, every value as logged), every key's latest value at the last step (``runs/get``), the rows
   of the run in the server's sqlite ``metrics`` table (count, and distinct key and step), the
   replay's ``delivered N`` line and the run's status (FINISHED, as the training process closed it).

Layout: ``--keys 10`` (100,000 steps of 10 values at 1,000,000), a training loop's few scalars (loss,
learning rate, grad norm, ...) over a long run: one journal record per ``log()`` call, so the most
records for the values, which is the replay's own per-record work; every batch of 1,000 values is
100 steps of the same 10 keys (MLflow updates 10 latest values per call). ``--keys 100`` is the
wide case (per-layer statistics): 10 steps per batch, 100 latest values updated per call.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import shlex
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from bench._common import REPO_ROOT, wait_until

EXPERIMENT = "bench-replay"
ANCHOR_EXPERIMENT = "bench-replay-anchor"
LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
RSS_EVERY_S = 0.05
SUBJECTS = ("anchor", "replay")

# The training process: it journals every value; nothing listens at its tracking URI.
WRITER = """
import json, sys, time
from otel_forge import ForgeConfig, TrainingRun

keys, steps = {keys}, {steps}
names = [{name!r}.format(k) for k in range(keys)]
run = TrainingRun(tracking_uri={uri!r}, experiment={experiment!r}, system_metrics=False,
                  forge_config=ForgeConfig.resolve(start_wait_s=0))
in_log, started = 0.0, time.perf_counter()
for step in range(steps):
    values = {{name: k + step / 1024 for k, name in enumerate(names)}}
    before = time.perf_counter()
    run.log(values, step=step)
    in_log += time.perf_counter() - before
logged = time.perf_counter()
run.close()
print(json.dumps({{"in_log_s": in_log, "loop_s": logged - started, "close_s": time.perf_counter() - logged,
                  "rejected": run.rejected}}))
"""
KEY_NAME = "bench/m{:03d}"


def value_of(key_index: int, step: int) -> float:
    """What the writer logs for key ``key_index`` at ``step`` (exact in binary: read back equal)."""
    return key_index + step / 1024


# --- the journal ------------------------------------------------------------------------------


def child_environ(spool: Path) -> dict[str, str]:
    from testkit.hermetic import hermetic_environ

    own = {
        "OTEL_FORGE_SPOOL_DIR": str(spool),
        "OTEL_FORGE_DELIVERY_PATIENCE": "1",  # its companion gives the journal up soon after its writer ends
        "OTEL_FORGE_PROMETHEUS": "false",
        "PYTHONPATH": str(REPO_ROOT),
    }
    return hermetic_environ(own, prefixes=("OTEL_", "MLFLOW_"))


def make_journal(spool: Path, keys: int, steps: int) -> dict[str, Any]:
    from testkit.servers import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    script = textwrap.dedent(WRITER.format(keys=keys, steps=steps, name=KEY_NAME, uri=dead, experiment=EXPERIMENT))
    started = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", script], env=child_environ(spool), cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    wall_s = time.perf_counter() - started
    if child.returncode != 0:
        raise RuntimeError(f"the training process failed ({child.returncode}): {child.stderr[-3000:]}")
    timings = json.loads(child.stdout.strip().splitlines()[-1])
    journals = sorted(spool.glob("journal-*"))
    if len(journals) != 1:
        raise RuntimeError(f"expected one journal in {spool}, found {journals}")
    (journal,) = journals
    # Its companion, told the end, gives the journal up once the server refuses it: then it is left.
    if not wait_until(lambda: _unlocked(journal), 120, 0.2):
        raise RuntimeError(f"{journal}'s delivery still holds it after 120 s")
    from otel_forge.mlflow.training.journal_cursor import undelivered

    kept = undelivered(journal)
    size = sum(path.stat().st_size for path in journal.iterdir() if path.is_file())
    return {
        "dead_uri": dead,
        "journal": str(journal),
        "journal_bytes": size,
        "values_kept": kept.values,
        "end_kept": kept.end,
        "run_opened": kept.run_id,
        "writer_wall_s": wall_s,
        **timings,
    }


def _unlocked(journal: Path) -> bool:
    """No process delivers ``journal`` now: the delivery's own lock is free (taken and let go)."""
    from otel_forge.mlflow.spool_files import SpoolBusy, claim

    if not (journal / "delivery.lock").exists():
        return True  # delivered whole and removed, or never delivered
    try:
        with claim(journal):
            return True
    except SpoolBusy:
        return False


# --- the counting proxy -----------------------------------------------------------------------


def counting_proxy(upstream: str) -> Any:
    """``MlflowProxy`` that counts requests by path and keeps no body (a million values parsed and
    kept would cost the bench's process ~1 GB and a JSON parse of every call): of a ``log-batch``, the
    metric values it carries (its ``"step"`` fields: tags and params have none)."""
    from testkit.proxy import MlflowProxy, _Request

    class CountingProxy(MlflowProxy):
        def _arrived(self, method: str, path: str, body: bytes) -> _Request:
            request = _Request(method, path, {"values": body.count(b'"step"')} if path == LOG_BATCH else None)
            with self._lock:
                self._requests.append(request)
            return request

    return CountingProxy(upstream)


def _batches(proxy: Any) -> list[int]:
    """The metric values each ``log-batch`` request carried, in arrival order."""
    return [body["values"] for _, body in proxy.arrivals(LOG_BATCH)]


def _window(proxy: Any, path: str) -> tuple[float, float] | None:
    """From the first request on ``path`` arriving to the last one answered (time.time())."""
    with proxy._lock:
        seen = [r for r in proxy._requests if r.path == path and r.answered_at is not None]
    if not seen:
        return None
    return min(r.arrived_at for r in seen), max(r.answered_at for r in seen)


# --- the subjects -----------------------------------------------------------------------------


def run_anchor(uri: str, keys: int, steps: int, batch: int) -> dict[str, Any]:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(uri)
    experiment_id = client.create_experiment(f"{ANCHOR_EXPERIMENT}-{time.time_ns()}")
    run_id = client.create_run(experiment_id).info.run_id
    names = [KEY_NAME.format(k) for k in range(keys)]
    timestamp = int(time.time() * 1000)
    calls, pending = 0, []
    cpu0, started = time.thread_time(), time.perf_counter()
    for step in range(steps):
        for k, name in enumerate(names):
            pending.append(Metric(name, value_of(k, step), timestamp + step, step))
            if len(pending) == batch:
                client.log_batch(run_id, metrics=pending)
                calls, pending = calls + 1, []
    if pending:
        client.log_batch(run_id, metrics=pending)
        calls += 1
    elapsed = time.perf_counter() - started
    cpu = time.thread_time() - cpu0
    with contextlib.redirect_stdout(sys.stderr):  # MLflow prints the run's and experiment's links
        client.set_terminated(run_id, "FINISHED")
    return {"run_id": run_id, "seconds": elapsed, "client_calls": calls, "client_cpu_s": cpu}


class TreeRss:
    """Samples the RSS of a process and its descendants every ``RSS_EVERY_S`` on a thread: the peak
    of their sum, and of the root alone."""

    def __init__(self, pid: int) -> None:
        self._root = psutil.Process(pid)
        self.peak_tree = self.peak_root = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                processes = [self._root, *self._root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    rss = process.memory_info().rss
                    total += rss
                    if process.pid == self._root.pid:
                        self.peak_root = max(self.peak_root, rss)
            self.peak_tree, self.samples = max(self.peak_tree, total), self.samples + 1
            self._stop.wait(RSS_EVERY_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def replay_command(uri: str) -> list[str]:
    return [sys.executable, "-m", "otel_forge.cli", "replay", "--all", "--tracking-uri", uri]


def run_replay(uri: str, spool: Path, profile: Path | None) -> dict[str, Any]:
    command = replay_command(uri)
    if profile is not None:  # main() returns: the command itself ends its process without cProfile's write
        script = "import cProfile, sys; from otel_forge.cli import main; "
        script += f"cProfile.run('main(sys.argv[1:])', {str(profile)!r})"
        command[1:3] = ["-c", script]
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    process = subprocess.Popen(
        command, env=child_environ(spool), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    rss = TreeRss(process.pid)
    try:
        stdout, stderr = process.communicate(timeout=7200)
    finally:
        rss.stop()
    elapsed = time.perf_counter() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the replay, reaped (and what it reaped)
    cpu_s = children.ru_utime + children.ru_stime - children_before.ru_utime - children_before.ru_stime
    if process.returncode != 0:
        raise RuntimeError(f"replay failed ({process.returncode}): {stderr[-3000:]}")
    said = re.search(r"delivered (\d+) metric value\(s\) to run (\w+)(?: and ended it (\w+))?", stdout)
    if said is None:
        raise RuntimeError(f"replay said no 'delivered' line: {stdout!r} {stderr[-2000:]!r}")
    return {
        "seconds": elapsed,
        "client_cpu_s": cpu_s,
        "delivered": int(said.group(1)),
        "run_id": said.group(2),
        "ended": said.group(3),
        "stdout": stdout.strip(),
        "peak_rss_tree_mib": rss.peak_tree / 2**20,
        "peak_rss_root_mib": rss.peak_root / 2**20,
        "rss_samples": rss.samples,
    }


# --- what the runs hold -----------------------------------------------------------------------


def check_run(uri: str, db: Path, run_id: str, keys: int, steps: int, history_keys: int) -> dict[str, Any]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    latest = run.data.metrics  # key -> latest value (MLflow: the value at the highest step)
    names = [KEY_NAME.format(k) for k in range(keys)]
    latest_ok = sorted(latest) == names and all(latest[n] == value_of(k, steps - 1) for k, n in enumerate(names))
    histories: dict[str, bool] = {}
    picked = sorted({round(i * (keys - 1) / max(history_keys - 1, 1)) for i in range(history_keys)})
    for k in picked:
        history = client.get_metric_history(run_id, names[k])
        seen = sorted((m.step, m.value) for m in history)
        histories[names[k]] = seen == [(step, value_of(k, step)) for step in range(steps)]
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:
        rows, distinct = connection.execute(
            "SELECT COUNT(*), COUNT(DISTINCT key || '@' || step) FROM metrics WHERE run_uuid = ?", (run_id,)
        ).fetchone()
    return {
        "status": run.info.status,
        "latest_keys": len(latest),
        "latest_ok": latest_ok,
        "histories_ok": histories,
        "db_rows": rows,
        "db_distinct_key_steps": distinct,
        "complete": bool(latest_ok and all(histories.values()) and rows == distinct == keys * steps),
    }


# --- the driver -------------------------------------------------------------------------------


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from testkit.mlflow_server import MlflowServer

    keys, steps = args.keys, args.values // args.keys
    if keys * steps != args.values:
        raise SystemExit(f"--values {args.values} is not a multiple of --keys {args.keys}")
    summary: dict[str, Any] = {
        "values": args.values,
        "keys": keys,
        "steps": steps,
        "batch": args.batch,
        "order": args.order,
        "machine": _machine(),
    }
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        spool = Path(tmp) / "spool"
        print(f"journal: {keys} keys x {steps:,} steps into {spool} (server down) ...", file=sys.stderr)
        summary["journal"] = make_journal(spool, keys, steps)
        print(f"journal: {json.dumps(summary['journal'])}", file=sys.stderr)
        with MlflowServer(Path(tmp)).start() as server, contextlib.closing(counting_proxy(server.uri)) as proxy:
            summary["server"] = server.uri
            summary["command"] = f"OTEL_FORGE_SPOOL_DIR={spool} " + shlex.join(
                ["otel-forge", *replay_command(proxy.uri)[3:]]
            )
            load_before = os.getloadavg()
            for subject in args.order:
                proxy.reset()
                load0, cpu0 = os.getloadavg(), _server_cpu(server)
                print(f"{subject}: {args.values:,} values to {proxy.uri} ...", file=sys.stderr)
                if subject == "anchor":
                    result = run_anchor(proxy.uri, keys, steps, args.batch)
                else:
                    print(f"  {summary['command']}", file=sys.stderr)
                    result = run_replay(proxy.uri, spool, args.profile)
                result["server_cpu_s"] = _server_cpu(server) - cpu0
                result["calls"] = dict(sorted(proxy.counts().items()))
                result["log_batch_calls"] = proxy.count(LOG_BATCH)
                batches = _batches(proxy)
                result["batches_with_values"] = sum(1 for n in batches if n)
                result["values_sent"] = sum(batches)
                result["batch_sizes"] = dict(sorted(Counter(batches).items()))
                window = _window(proxy, LOG_BATCH)
                result["delivering_s"] = window[1] - window[0] if window else None
                result["load_before"] = load0
                result["check"] = check_run(server.uri, server.db, result["run_id"], keys, steps, args.history_keys)
                summary.setdefault(subject, []).append(result)
                print(f"{subject}: {_one_line(result, args.values)}", file=sys.stderr)
            summary["load_before"], summary["load_after"] = load_before, os.getloadavg()
    return _figures(summary)


def _server_cpu(server: Any) -> float:
    from bench._common import tree_cpu_s

    return tree_cpu_s(server.process.pid if server.process else None)


def _machine() -> dict[str, Any]:
    import mlflow

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mlflow": mlflow.__version__,
        "platform": platform.platform(),
    }


def _one_line(result: dict[str, Any], values: int) -> str:
    return (
        f"{result['seconds']:.1f} s, {values / result['seconds']:,.0f} values/s, "
        f"{result['log_batch_calls']} log-batch, complete: {result['check']['complete']}"
    )


def _figures(summary: dict[str, Any]) -> dict[str, Any]:
    values = summary["values"]
    anchors, replays = summary.get("anchor", []), summary.get("replay", [])
    figures: dict[str, Any] = {}
    if anchors:
        figures["anchor_values_per_s"] = values / _mean(a["seconds"] for a in anchors)
        figures["anchor_values_per_s_each"] = [values / a["seconds"] for a in anchors]
    if replays:
        replay = replays[-1]
        figures["replay_wall_s"] = replay["seconds"]
        figures["replay_values_per_s"] = values / replay["seconds"]
        if replay["delivering_s"]:
            figures["replay_delivering_values_per_s"] = values / replay["delivering_s"]
        figures["replay_peak_rss_mib"] = replay["peak_rss_tree_mib"]
        figures["replay_log_batch_calls"] = replay["log_batch_calls"]
        figures["replay_delivered"] = replay["delivered"]
    if anchors and replays:
        # Against the anchors' mean, and against each (the machine's load moves between them).
        figures["ratio"] = figures["replay_values_per_s"] / figures["anchor_values_per_s"]
        figures["ratio_each"] = [figures["replay_values_per_s"] / rate for rate in figures["anchor_values_per_s_each"]]
        if "replay_delivering_values_per_s" in figures:
            figures["ratio_delivering"] = figures["replay_delivering_values_per_s"] / figures["anchor_values_per_s"]
    figures["all_complete"] = all(r["check"]["complete"] for r in [*anchors, *replays]) and all(
        r["delivered"] == r["values_sent"] == values for r in replays
    )
    summary["figures"] = figures
    return summary


def _mean(numbers: Any) -> float:
    seq = list(numbers)
    return sum(seq) / len(seq)


def table(summary: dict[str, Any]) -> str:
    values, figures = summary["values"], summary["figures"]
    anchor_rate = figures.get("anchor_values_per_s")
    lines = [
        f"{values:,} values ({summary['keys']} keys x {summary['steps']:,} steps), batches of "
        f"{summary['batch']:,}; {summary['machine']['cpus']} CPUs, Python {summary['machine']['python']}, "
        f"mlflow {summary['machine']['mlflow']}; a private `mlflow server` (sqlite, one worker) behind a counting "
        f"proxy; load average before {summary['load_before'][0]:.2f}, after {summary['load_after'][0]:.2f}.",
        "",
        "| subject | wall s | values/s | x anchors' mean (x each) | delivering: s, values/s "
        "| `log-batch` calls (with values) | other calls | client CPU s (µs a value) | peak RSS, MiB | server CPU s "
        "| what the run holds |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    taken: Counter[str] = Counter()
    for subject in summary["order"]:
        result = summary[subject][taken[subject]]
        taken[subject] += 1
        rate = values / result["seconds"]
        ratio = f"{rate / anchor_rate:.2f}" if anchor_rate else ""
        if subject == "replay" and len(figures.get("ratio_each", ())) > 1:
            ratio += f" ({', '.join(f'{r:.2f}' for r in figures['ratio_each'])})"
        delivering = result["delivering_s"]
        window = f"{delivering:.1f}, {values / delivering:,.0f}" if delivering else ""
        others = ", ".join(f"{path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]} {n}"
                           for path, n in result["calls"].items() if path != LOG_BATCH)  # fmt: skip
        name = "`otel-forge replay --all`" if subject == "replay" else "MLflow `log_batch`, one thread"
        rss = f"{result['peak_rss_tree_mib']:.0f}" if subject == "replay" else ""
        lines.append(
            f"| {name} | {result['seconds']:.1f} | {rate:,.0f} | {ratio} | {window} "
            f"| {result['log_batch_calls']:,} ({result['batches_with_values']:,}) | {others} "
            f"| {result['client_cpu_s']:.1f} ({result['client_cpu_s'] / values * 1e6:.0f}) | {rss} "
            f"| {result['server_cpu_s']:.0f} | {_complete(result['check'])} |"
        )
    journal = summary["journal"]
    lines += [
        "",
        f"Journal: {journal['values_kept']:,} values and the run's end ({journal['end_kept']}) kept, "
        f"{journal['journal_bytes'] / 2**20:.1f} MiB; the training process spent {journal['in_log_s']:.2f} s in "
        f"`log()` ({journal['in_log_s'] / values * 1e6:.2f} µs a value, wall) and {journal['close_s']:.1f} s closing.",
        f"Replay: `{summary['command']}`",
    ]
    return "\n".join(lines)


def _complete(check: dict[str, Any]) -> str:
    histories = sum(check["histories_ok"].values())
    return (
        f"{'yes' if check['complete'] else 'NO'}: {check['db_rows']:,} rows ({check['db_distinct_key_steps']:,} "
        f"key-steps), {check['latest_keys']} latest {'ok' if check['latest_ok'] else 'WRONG'}, "
        f"{histories}/{len(check['histories_ok'])} histories whole, {check['status']}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=1_000_000, help="values in the journal (default 1,000,000)")
    parser.add_argument("--keys", type=int, default=10, help="keys logged at every step (default 10)")
    parser.add_argument("--batch", type=int, default=1000, help="the anchor's values per log_batch (default 1,000)")
    parser.add_argument(
        "--order", nargs="+", choices=SUBJECTS, default=["anchor", "replay", "anchor"],
        help="subjects in turn, each into a fresh run of the same server (default: anchor replay anchor)",
    )  # fmt: skip
    parser.add_argument("--history-keys", type=int, default=3, help="keys whose whole history is read back (3)")
    parser.add_argument("--profile", type=Path, help="run the replay under cProfile, its stats written there")
    parser.add_argument("--json", action="store_true", help="only the JSON summary")
    args = parser.parse_args(argv)
    if args.order.count("replay") > 1:
        raise SystemExit("--order: the journal is replayed once")
    summary = run_bench(args)
    print(json.dumps(summary, indent=2))
    if not args.json:
        print()
        print(table(summary))


if __name__ == "__main__":
    main()
