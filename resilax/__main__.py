import sys

from resilax.tools.cli import main

sys.exit(main())
