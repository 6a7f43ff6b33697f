"""The Locust user, for `locust -f loadtest/locustfile.py --host ...`; its code is `peagle_loadtest.locustfile`.

The folder beside this file goes first on the path, so a bare checkout (e.g. mounted into a Locust container)
loads the same code as an installed project.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peagle_loadtest.locustfile import *  # noqa: E402,F401,F403  (Locust finds the User classes here)
