import sys

from sglang_marconi.plan.cli import main

sys.exit(main())
