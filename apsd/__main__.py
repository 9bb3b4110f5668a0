import sys

from apsd.cli import main

sys.exit(main())
