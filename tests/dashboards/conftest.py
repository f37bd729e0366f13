import sys
from pathlib import Path

# The helpers beside these tests (grafana_queries.py, collector_form.py) are plain modules.
sys.path.insert(0, str(Path(__file__).parent))
