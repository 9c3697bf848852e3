"""Other nodes of a stack: reached over OpenSSH with a key bound to a forced command (`agent`), one multiplexed
connection per node (`transport`), what goes over it (`protocol`, pure), rank liveness (`liveness`), and the
adapters the evidence and act stages use (`remote`)."""
