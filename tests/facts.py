"""What a generated sentence says, checked without pinning how it says it.

Reasons, headlines, culprit lines and hints are prose: a test that pins the whole sentence breaks on a reworded
phrase and proves nothing more. ``says`` checks the facts in it instead (the rank, the class, the node, the numbers,
the key words), each as a whole token, so a wrong rank or number still fails: ``Worker_TP1`` is not found in
``Worker_TP10``, nor ``2.7`` in ``12.75``, nor ``3`` in ``30``.
"""

from __future__ import annotations

import re


def _token(fact: object) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w.]){re.escape(str(fact))}(?!\w|\.\d)", re.IGNORECASE)


def unsaid(text: str, *facts: object) -> list[str]:
    """The facts ``text`` does not state (case aside), in the order given."""
    return [str(f) for f in facts if not _token(f).search(text)]


def says(text: str, *facts: object) -> bool:
    """Whether ``text`` states every fact, each as a whole token, in any order and wording around them."""
    return not unsaid(text, *facts)


def line_of(text: str, *facts: object) -> str:
    """The first line of ``text`` that states every fact; "" when none does (so a check on it fails)."""
    return next((line for line in text.splitlines() if says(line, *facts)), "")


def clause_of(text: str, *facts: object) -> str:
    """The first clause (a line cut at ``; `` and ``. ``) that states every fact, to tie facts to one subject: the
    rank a sentence blames and what it says that rank does; "" when none does."""
    parts = (c for line in text.splitlines() for c in re.split(r"(?<=[;.]) ", line))
    return next((c for c in parts if says(c, *facts)), "")
