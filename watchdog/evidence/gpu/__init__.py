"""GPU evidence: ``readings`` (NVML samples judged, pure), ``culprit`` (the GPU's word on the culprit, pure),
``flight_recorder`` and ``nccl_ras`` (their formats), ``nvml`` (the sampler thread), ``fr_trigger`` (a Flight
Recorder dump on demand), ``gather`` (all of it for a bundle)."""
