import sys
from pathlib import Path

# collector_lint.py and stack.py are plain modules beside these tests.
sys.path.insert(0, str(Path(__file__).parent))
