"""Judge: observations in, verdicts out. Pure: no I/O, no clock (time arrives with each observation)."""
