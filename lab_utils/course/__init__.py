"""The course around the engine: the parts each lab asks a learner to write (`parts.py`), the learner's saved parts
(`learner_parts.py`) and the learner copies of the labs (`learner_copies.py`). The course calls down into the
engine (its seam `lab_utils.engine.replaceable`, its invariants `lab_utils.engine.invariants`, which check a
learner's part while the engine runs it); the engine imports none of it."""
