#!/usr/bin/env python3
"""Every relative link and #anchor in README.md and docs/*.md resolves: the file exists, and the anchor is a
heading of that file (GitHub's rule: lower case, punctuation but '-' and '_' dropped, spaces to '-', a
repeated heading numbered -1, -2, ...). Prints each broken link as file:line; exits 1 when there is one."""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
docs = [os.path.join(root, "README.md")] + sorted(
    os.path.join(root, "docs", name) for name in os.listdir(os.path.join(root, "docs")) if name.endswith(".md"))

def anchors(path):
    seen, out, fenced = {}, set(), False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        text = re.sub(r"[`*]", "", line.lstrip("#").strip())
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out

broken = []
for doc in docs:
    fenced = False
    for number, line in enumerate(open(doc, encoding="utf-8"), 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(file):
                broken.append(f"{os.path.relpath(doc, root)}:{number}: '{target}': no file {os.path.relpath(file, root)}")
            elif anchor and file.endswith(".md") and anchor not in anchors(file):
                broken.append(f"{os.path.relpath(doc, root)}:{number}: '{target}': no heading #{anchor}")
for b in broken:
    print(b)
print(f"{len(docs)} documents, {len(broken)} broken links")
sys.exit(1 if broken else 0)
