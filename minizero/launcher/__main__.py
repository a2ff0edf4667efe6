import sys

from minizero.launcher.runner import main

sys.exit(main())
