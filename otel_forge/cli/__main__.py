import sys

from otel_forge.cli import main

sys.exit(main())
