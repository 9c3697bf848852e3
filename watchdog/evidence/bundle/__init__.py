"""Bundle: ``write`` (incident directories, retention), ``per_node`` (what each node's evidence holds, pure),
``investigate`` (find, capture, assess, write; in a background thread), ``coordinator`` (which verdicts ask for
stacks, and where the answers go)."""
