import sys

from bertjax.cli import main

sys.exit(main())
