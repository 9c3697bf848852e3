"""Explain (pure): ``classes`` (the class words), ``frame_rules`` (frames to a class), ``ranks`` (each process, the
culprit across ranks, the poll-parking verdict), ``findings`` (a capture assessed: the decision on a suspicion)."""
