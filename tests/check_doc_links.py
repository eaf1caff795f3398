#!/usr/bin/env python3
"""The documents' references resolve, and no file of the repository refers to work tickets or work periods.

- Every relative link and #anchor in README.md and docs/*.md resolves: the file exists, and the anchor is a
  heading of that file (GitHub's rule: lower case, punctuation but '-' and '_' dropped, spaces to '-', a
  repeated heading numbered -1, -2, ...).
- Every `path:function` reference in those documents (the reading path of docs/design.md among them) names a
  file that exists and a function defined in it: `name(` after a return type or a `Class::` qualifier, and
  for `Class::name` that qualified definition (or, in a header, the class and the member).
- No tracked text file says "issue N" or the word for a work period (the history lives in git log).
Prints each problem as file:line; exits 1 when there is one."""
import os
import re
import subprocess
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
# `path:function` references: a source path, a colon, a C++ name (qualified or not).
STOP = re.compile(r"`([\w./-]+\.(?:h|cpp|cu|cuh)):([A-Za-z_~][\w:~]*)`")

def defines(path, name):
    text = open(path, encoding="utf-8").read()
    cls, _, member = name.rpartition("::")
    # A definition (or declaration) puts a type, a '*', '&' or '>' before the name; a call puts 'return',
    # '=', '(' or ',' there.
    qualified = re.escape(name) + r"\s*\("
    if re.search(r"(?m)^[\w:<>,*& ]*?[\w>*&]\s+" + qualified, text):
        return True
    if cls:
        in_class = re.search(r"\b(?:class|struct)\s+" + re.escape(cls.split("::")[-1]) + r"\b", text)
        return bool(in_class) and re.search(r"(?m)^\s*[\w:<>,*& ]*?[\w>*&]\s+" + re.escape(member) + r"\s*\(",
                                            text) is not None
    return False

for doc in docs:
    for number, line in enumerate(open(doc, encoding="utf-8"), 1):
        for path, name in STOP.findall(line):
            file = os.path.join(root, path)
            if not os.path.exists(file):
                broken.append(f"{os.path.relpath(doc, root)}:{number}: '{path}:{name}': no file {path}")
            elif not defines(file, name):
                broken.append(f"{os.path.relpath(doc, root)}:{number}: '{path}:{name}': {path} defines no {name}")

# Tickets and work periods: the words are assembled so that this file does not match itself.
FORBIDDEN = re.compile(r"\b(?:issue #?\d+|" + "sess" + r"ions?)\b", re.IGNORECASE)
TEXT = (".md", ".h", ".cpp", ".cu", ".cuh", ".py", ".sh", ".cmake", ".txt", ".json", "run")
def tracked_files():
    try:
        listed = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True, check=True)
        return listed.stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (a source tarball): walk it
        found = []
        for top, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith((".", "build"))]
            found += [os.path.relpath(os.path.join(top, f), root) for f in files]
        return found
for name in tracked_files():
    if not name.endswith(TEXT) or not os.path.isfile(os.path.join(root, name)):
        continue
    for number, line in enumerate(open(os.path.join(root, name), encoding="utf-8", errors="replace"), 1):
        match = FORBIDDEN.search(line)
        if match:
            broken.append(f"{name}:{number}: says '{match.group(0)}': the history lives in git log")

for b in broken:
    print(b)
print(f"{len(docs)} documents, {len(broken)} problems")
sys.exit(1 if broken else 0)
