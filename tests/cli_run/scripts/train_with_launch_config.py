"""examples/train_plain_mlflow.py (copied beside this file), launched with a config file on its command line.

    otel-forge run -- python train_with_launch_config.py --steps 20 cfg.toml

The example's argparse knows no positional config: the config file names are taken off argv here and
the example runs unchanged. otel-forge finds the file on the command line it launched.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.argv = [arg for arg in sys.argv if not arg.lower().endswith((".toml", ".yaml", ".yml", ".json"))]
runpy.run_path(str(Path(__file__).with_name("train_plain_mlflow.py")), run_name="__main__")
