"""The job's GPU energy (issue 42, part 7): each GPU's energy counter from ``otel-forge run``'s first
read of the node's GPUs to its last, summed over the node's GPUs, in kWh and in joules per optimizer
step (the steps the job took: each attempt's most steps of a rank on the node, summed over attempts).

End to end: a real ``otel-forge run`` over the fake NVML (tests/fakes/pynvml.py) with two GPUs whose
counters are scenario sequences: each GPU's counter climbs by a known amount over the first reads,
then holds, so the job's energy is exactly that growth however many reads the job lasts. CMD is
tests/progress/scripts/energy_steps.py, a tiny torch loop (no otel_forge code) taking a known number
of optimizer steps, that exits, or SIGKILLs itself after its steps: ``otel-forge run`` outlives it and
the figures reach the run either way (``system/gpu_energy_kwh``, ``system/gpu_energy_joules_per_step``
and ``energy/<host>.json``), against the session's real ``mlflow server``.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from otel_forge.collectors.base import Readings
from otel_forge.collectors.progress import gpus_from
from otel_forge.progress.energy import JobEnergy, NodeGpus
from testkit.gpu_fakes import SCENARIO_ENV, fake_gpu_env
from testkit.hermetic import hermetic_environ

FORGE_RUN = [sys.executable, "-m", "otel_forge.cli", "run"]
STEPS_SCRIPT = Path(__file__).resolve().parent / "scripts" / "energy_steps.py"
RUN_LINE = re.compile(r"^otel-forge: run ([0-9a-f]{32}) ", re.MULTILINE)

STEPS = 12
# Each GPU's counter (J): where it starts and how much it grows over the job.
COUNTERS = {"0": (5_000_000, 1_800_000), "1": (7_000_000, 2_520_000)}
JOULES = sum(growth for _, growth in COUNTERS.values())  # 4_320_000 J
KWH = JOULES / 3.6e6  # 1.2 kWh
JOULES_PER_STEP = JOULES / STEPS  # 360_000 J
RAMP_READS = 4  # the counters reach their end value at the 5th read, and hold it (~15 min of reads at 0.3 s)


def _scenario() -> dict[str, Any]:
    def counter(start: float, growth: float) -> list[float]:
        return [start + growth * read / RAMP_READS for read in range(RAMP_READS + 1)] + [start + growth] * 3000

    sequences = {gpu: {"energy": counter(start, growth)} for gpu, (start, growth) in COUNTERS.items()}
    return {"count": len(COUNTERS), "amd": False, "sequences": sequences}


# --- JobEnergy, in process ------------------------------------------------------------------------


def _gpus(*joules: float) -> NodeGpus:
    return NodeGpus(sum(joules), (), {f"nvidia:{index}": value for index, value in enumerate(joules)})


def _progress(*ranks: tuple[int, int]) -> Any:
    """A look at the ranks (attempt, steps): what ``JobEnergy.add_steps`` reads of a ``JobProgress``."""
    views = [SimpleNamespace(progress=SimpleNamespace(identity=SimpleNamespace(restart=a), steps=s)) for a, s in ranks]
    return SimpleNamespace(ranks=views)


def test_the_energy_counts_from_the_first_read_before_any_step_over_every_step() -> None:
    energy = JobEnergy()
    energy.add_gpus(_gpus(1000.0, 2000.0))  # otel-forge run's first read: CMD has not stepped yet
    energy.add_steps(_progress((0, -1)))  # a rank that has not stepped
    assert energy.per_step is None
    energy.add_gpus(_gpus(1300.0, 2500.0))  # start-up energy, before the first step: the job's too
    energy.add_steps(_progress((0, 4), (0, 3)))
    assert energy.joules == 800.0
    assert energy.per_step == 200.0  # 800 J over the 4 steps the job took (the most of a rank)


def test_a_restarted_job_counts_every_attempts_steps() -> None:
    energy = JobEnergy()
    energy.add_gpus(_gpus(0.0))
    energy.add_steps(_progress((0, 10), (0, 9)))
    energy.add_steps(_progress((1, 5), (1, 6)))  # torchrun's second attempt starts again from 0 steps
    energy.add_gpus(_gpus(3200.0))
    assert energy.steps == 16
    assert energy.per_step == 200.0


def test_the_end_takes_a_last_read_and_a_gpu_that_stops_answering_keeps_its_last_reading() -> None:
    reads = iter([_gpus(600.0, 900.0)])
    energy = JobEnergy()
    energy.read_through(lambda: next(reads))
    energy.add_gpus(_gpus(100.0, 200.0))
    energy.add_gpus(NodeGpus(450.0, (), {"nvidia:0": 450.0}))  # GPU 1 did not answer this read
    final = energy.at_end("node-a", _progress((0, 10)))
    assert final == {"node": "node-a", "gpus": 2, "kwh": 1200.0 / 3.6e6, "joules": 1200.0, "steps": 10,
                     "joules_per_step": 120.0}  # fmt: skip
    # A read that fails at the end (the agent is stopping) leaves the last collect's reading.
    assert energy.at_end("node-a", None) == final


def test_no_gpu_energy_read_is_no_figure() -> None:
    energy = JobEnergy()
    energy.read_through(lambda: NodeGpus(None, ()))
    energy.add_steps(_progress((0, 10)))
    assert energy.per_step is None and energy.at_end("node-a", None) is None


def test_gpus_from_keeps_each_whole_gpus_counter() -> None:
    readings = Readings()
    readings.add("hw.energy", 10.0, {"hw.id": "0", "hw.vendor": "nvidia"})
    readings.add("hw.energy", 20.0, {"hw.id": "1", "hw.vendor": "nvidia"})
    readings.add("hw.energy", 1.0, {"hw.id": "1_mig1", "hw.vendor": "nvidia", "hw.parent": "1"})
    gpus = gpus_from(lambda: [readings])()
    assert dict(gpus.energy_by_gpu) == {"nvidia:0": 10.0, "nvidia:1": 20.0}


# --- otel-forge run, end to end -------------------------------------------------------------------


def _last(client: Any, run_id: str, key: str) -> float:
    history = client.get_metric_history(run_id, key)
    assert history, f"no {key} in the run"
    return max(history, key=lambda metric: (metric.step, metric.timestamp)).value


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["exits", "sigkilled"])
def test_the_job_energy_reaches_the_run_exactly(mlflow_server: Any, client: Any, tmp_path: Path, ending: str) -> None:
    scenario = tmp_path / "gpus.json"
    scenario.write_text(json.dumps(_scenario()))
    base = hermetic_environ({"OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool")}, prefixes=("OTEL_", "MLFLOW_"))
    env = {**fake_gpu_env(None, base=base), SCENARIO_ENV: str(scenario)}
    experiment = f"energy-{ending}-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, str(STEPS_SCRIPT), str(STEPS), *(["--kill"] if ending == "sigkilled" else [])]
    result = subprocess.run(
        [*FORGE_RUN, "--tracking-uri", mlflow_server.uri, "--experiment", experiment, "--no-prometheus",
         "--interval", "0.3", "--collectors", "nvidia", "--", *cmd],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert f"steps taken {STEPS}" in result.stdout, result.stderr
    assert result.returncode == (0 if ending == "exits" else 128 + 9), result.stderr
    found = RUN_LINE.search(result.stderr)
    assert found is not None, result.stderr
    run_id = found.group(1)
    assert client.get_run(run_id).info.status == ("FINISHED" if ending == "exits" else "KILLED")

    # The node's kWh (every GPU, since otel-forge run's first read) and per step, as sampled.
    assert _last(client, run_id, "system/gpu_energy_kwh") == pytest.approx(KWH, rel=1e-12)
    assert _last(client, run_id, "system/gpu_energy_joules_per_step") == pytest.approx(JOULES_PER_STEP, rel=1e-12)

    # The node's figure at the job's end: energy/<host>.json.
    host = socket.gethostname()
    assert [artifact.path for artifact in client.list_artifacts(run_id, "energy")] == [f"energy/{host}.json"]
    figure = json.loads(Path(client.download_artifacts(run_id, f"energy/{host}.json", str(tmp_path))).read_text())
    assert figure == {
        "node": host,
        "gpus": len(COUNTERS),
        "kwh": pytest.approx(KWH, rel=1e-12),
        "joules": pytest.approx(JOULES, rel=1e-12),
        "steps": STEPS,
        "joules_per_step": pytest.approx(JOULES_PER_STEP, rel=1e-12),
    }
