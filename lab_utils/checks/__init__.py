"""Exercise checkers: one module per lab (`lab_utils.checks.lab00` ...), helpful failure messages, never the solution."""

import os as _os

if _os.environ.get("LAB_STEP_FLOOR_S"):  # the launch-bound step-cost profile for this process (checks.timing)
    from lab_utils.checks.timing import step_floor_from_env as _floor

    _floor()
