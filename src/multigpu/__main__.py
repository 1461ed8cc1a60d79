import sys

from multigpu.cli.entry import main

sys.exit(main())
