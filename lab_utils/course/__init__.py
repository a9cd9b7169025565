"""The course around the engine: the parts each lab asks a learner to write (`parts.py`), the guards that check a
learner's part while the engine runs it (`guards.py`), the learner's saved parts (`learner_parts.py`) and the learner
copies of the labs (`learner_copies.py`). The reference engine imports none of it (the
slot-mapping guard is imported only when a learner's slot mapping runs)."""
