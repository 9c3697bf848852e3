"""Other nodes of a stack: reached over OpenSSH with a key bound to a forced command (`agent`, allowed by
`agent_config`), its arguments checked (`arguments`, pure), the engine's processes told from others (`identity`), its
audit log (`audit`), one multiplexed connection per node (`transport`), what goes over it (`protocol`, pure), rank
liveness (`liveness` pure, `watch`, `ranks`), the node's /dev/shm (`shm`), the other nodes' evidence and
commands for the stages above (`remote`), a node's set-up texts (`enrol`, pure) and what is still wrong with a node,
each with its fix (`findings`, pure). Stands on ``evidence``, ``config``, ``host`` and ``core``; never on
``act``. docs/threat-model.md says who is trusted with what."""
