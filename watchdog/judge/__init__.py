"""Judge: observations in, verdicts out. Pure: no I/O, no clock (time arrives with each observation).

``judge`` (each engine's state decided from its observations), ``track`` (what the judge keeps between
observations: thresholds, one track per engine, the probe's last round)."""
