"""engine-watchdog: notices when a vLLM engine stops producing tokens, and says why.

The package follows the pipeline, one module per stage:
scrape -> judge -> (probe) -> daemon -> report (exporter, events).
"""

__version__ = "0.1.0"
# Marker that tells this package apart from the unrelated PyPI `watchdog` (filesystem events).
ENGINE_WATCHDOG = True
