"""Stacks (pure): dumps read into ``frames`` (the stack model every parser produces: ``ProcessStack``,
``ThreadStack``, ``Frame``): ``parse`` (any format, py-spy JSON), ``text`` and ``lines`` (the text formats: py-spy
text, faulthandler, Python tracebacks, gdb, kernel stacks)."""
