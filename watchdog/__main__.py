import sys

from watchdog.cli.main import main

sys.exit(main())
