"""Temporary alias of ``workers.steps.runner`` while imports move (removed before commit)."""

import sys

from workers.steps import runner

sys.modules[__name__] = runner
