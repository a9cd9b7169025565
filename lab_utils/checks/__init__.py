"""Exercise checkers: one module per lab (`lab_utils.checks.lab00` ...), helpful failure messages, never the solution."""
