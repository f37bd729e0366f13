"""What the tests and the benches share: real servers and what they run against.

``servers`` (free ports, waiting, a Prometheus server and ``otel-forge monitor`` processes),
``mlflow_server`` (a real ``mlflow server``), ``proxy`` (a counting, failing proxy in front of it),
``hermetic`` (an environment without outside settings), ``gpu_fakes`` (the fake NVML and amdsmi of
``tests/fakes``) and ``git_repo`` (committed repositories). Imported as ``testkit.<module>`` from the
repository root: pytest's ``pythonpath`` holds it for the tests, ``python -m bench.<name>`` for the
benches. Not part of the package.
"""
