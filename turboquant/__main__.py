import sys

from turboquant.cli import main

sys.exit(main())
