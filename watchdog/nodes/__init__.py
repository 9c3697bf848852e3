"""Other nodes of a stack: reached over OpenSSH with a key bound to a forced command (`agent`, allowed by
`agent_config`), one multiplexed connection per node (`transport`), what goes over it (`protocol`, pure), rank
liveness (`liveness` pure, `watch`, `ranks`), the node's /dev/shm (`shm`), and the other nodes' evidence and
commands for the stages above (`remote`). Stands on ``evidence``, ``config``, ``host`` and ``core``; never on
``act``."""
