import sys

from kenosis_rewrite.cli.main import main

sys.exit(main())
