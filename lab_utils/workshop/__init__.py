"""A workshop for a room: check records, the gradebook, the instructor's board and the JupyterHub set-up.

`records` runs inside every learner's kernel (light: standard library only); the rest runs on the hub's side.
"""
