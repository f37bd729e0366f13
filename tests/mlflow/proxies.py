"""The counting proxy is ``MlflowProxy`` of tests/proxy.py now: use that in tests.

This file stays for bench/mlflow_export.py, which loads it by path (tests/ is not on its sys.path)
and uses ``CountingProxy``: it loads tests/proxy.py the same way and re-exports it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("otel_forge_tests_proxy",
                                              Path(__file__).resolve().parents[1] / "proxy.py")
assert _spec is not None and _spec.loader is not None
_proxy = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _proxy
_spec.loader.exec_module(_proxy)

CountingProxy = _proxy.MlflowProxy
Mode = _proxy.Mode
LOG_BATCH = _proxy.LOG_BATCH
GET_RUN = _proxy.GET_RUN
