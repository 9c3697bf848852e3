"""GPU evidence: ``readings`` (NVML samples judged, pure), ``culprit`` (the GPU's word on the culprit, pure),
``flight_recorder`` and ``ras_status`` (the Flight Recorder's and NCCL RAS's answers read, pure), ``fr_dump`` (a
recorder dump's bytes decoded), ``nccl_ras`` (RAS asked), ``nvml`` (the sampler thread), ``fr_trigger`` (a Flight
Recorder dump on demand), ``gather`` (all of it for a bundle)."""
