import sys
from pathlib import Path

# Test helpers (servers.py, gpu_fakes.py) are plain modules beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
