"""Reading the docs' Markdown as GitHub shows it: prose without fenced code, and the anchors
its headings get."""

import re


def prose(text: str) -> str:
    """Markdown without fenced code blocks, where links are not links."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces to
    hyphens, a -N suffix on repeats."""
    anchors: set[str] = set()
    for line in prose(markdown).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).lower()
        base = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        anchor, n = base, 0
        while anchor in anchors:
            n += 1
            anchor = f"{base}-{n}"
        anchors.add(anchor)
    return anchors
