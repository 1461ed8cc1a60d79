import sys

from multigpu.cli.main import main

sys.exit(main())
