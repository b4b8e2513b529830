#!/usr/bin/env python3
"""Every relative link of README.md, BENCHMARKS.md and docs/ resolves: the file it names exists
and, for a link with a #fragment into a Markdown file, that file has a heading of that slug
(GitHub's: lower case, punctuation but hyphens and underscores dropped, spaces as hyphens).
Links with a scheme (https:, mailto:) are not fetched. Exits 1 naming every broken link."""

import glob
import os
import re
import sys

LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    text = re.sub(r"[`*_]{1,2}(.+?)[`*_]{1,2}", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    found, fenced = set(), False
    with open(path, encoding="utf-8") as markdown:
        for line in markdown:
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            match = None if fenced else HEADING.match(line)
            if match:
                found.add(slug(match.group(1)))
    return found


def main() -> int:
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    pages = ["README.md", "BENCHMARKS.md", *sorted(glob.glob("docs/**/*.md", recursive=True))]
    broken = []
    for page in pages:
        with open(page, encoding="utf-8") as markdown:
            text = markdown.read()
        for match in LINK.finditer(text):
            target = match.group(1)
            if re.match(r"^[a-zA-Z][a-zA-Z+.-]*:", target):
                continue
            path, _, fragment = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(resolved):
                broken.append(f"{page}: {target} (no {resolved})")
            elif fragment and resolved.endswith(".md") and fragment.lower() not in anchors(resolved):
                broken.append(f"{page}: {target} (no heading #{fragment} in {resolved})")
    for line in broken:
        print(f"broken link: {line}")
    print(f"links: {len(pages)} pages checked, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
