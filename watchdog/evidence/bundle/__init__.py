"""Bundle: ``write`` (incident directories, retention), ``per_node`` (what each node's evidence holds, pure),
``investigate`` (find, capture, assess, write; in a background thread), ``coordinator`` (which verdicts ask for
stacks, and where the answers go); ``upstream`` (a bug report for the engine's tracker from one bundle, pure) with
``timeline`` (the incident's events and stall, pure) and ``redact`` (what such text may say, pure)."""
