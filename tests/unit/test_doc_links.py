"""Every link between the README, docs/ and runbooks/ leads somewhere: the file exists, and a `#section` names a
heading of that file (GitHub's anchors). The README sends the newcomer to these pages; a moved section must not
leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "runbooks").glob("*.md"))]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


def dead_links(page: Path) -> list[str]:
    dead = []
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, section = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            dead.append(f"{target} (no such file)")
        elif section and where.suffix == ".md" and section not in anchors(where):
            dead.append(f"{target} (no such heading)")
    return dead


def test_every_link_in_the_readme_docs_and_runbooks_leads_somewhere() -> None:
    dead = {str(p.relative_to(ROOT)): d for p in pages() if (d := dead_links(p))}
    assert not dead, f"dead links: {dead}"


def test_anchor_is_githubs(tmp_path: Path) -> None:
    assert anchor("Two nodes: how it works") == "two-nodes-how-it-works"
    assert anchor("Default thresholds, and why") == "default-thresholds-and-why"
    assert anchor("Behind a load balancer / in Kubernetes") == "behind-a-load-balancer--in-kubernetes"
    page = tmp_path / "a.md"
    page.write_text("# Title\n\n[here](#title) [there](#nowhere) [gone](b.md) [web](https://example.org/x)\n")
    assert dead_links(page) == ["#nowhere (no such heading)", "b.md (no such file)"]
