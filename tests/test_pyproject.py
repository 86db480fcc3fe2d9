"""pyproject.toml's pointers into the README name sections that exist."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pyproject_readme_references_name_existing_sections():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        pyproject = f.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        headings = {m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", f.read(), flags=re.M)}
    assert re.search(r'^readme = "README.md"$', pyproject, flags=re.M)
    references = re.findall(r'README, "([^"]+)"', pyproject)
    anchors = re.findall(r"README\.md#([\w-]+)", pyproject)
    assert references or anchors
    slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
    for section in references:
        assert section in headings, (section, sorted(headings))
    for anchor in anchors:
        assert anchor in slugs, (anchor, sorted(slugs))
