import sys

from disagg.cli import main

sys.exit(main())
