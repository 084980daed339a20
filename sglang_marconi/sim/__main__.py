import sys

from sglang_marconi.sim.cli import main

sys.exit(main())
