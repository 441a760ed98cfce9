"""``python -m oxygen_ros.tools.bench``: the same as ``oxygen bench`` (``command.main``)."""
import sys

from .command import main

sys.exit(main())
