import sys

from kenosis_rewrite.cli import main

sys.exit(main())
