"""Explain (pure): ``classes`` (the class words), ``frame_rules`` (frames to a class), ``ranks`` (each process, the
culprit across ranks, the poll-parking verdict), ``ring_layout`` and ``ring_said`` (the broadcast ring's flags read
by its version's layout, said in words), ``engine_scope`` (which processes serve which engine of a data-parallel
server), ``findings`` (a capture assessed: the decision on a suspicion, a lost wake-up or diverged ranks),
``headline`` (the sentence from the cause down), ``known_hangs`` (the vLLM hangs the evidence matches, with the
release that fixed them) and ``log_cause`` (why a down engine died, from its log)."""
