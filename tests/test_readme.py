"""README.md: its Python block runs as written and does what its comments say; every
relative link in README.md and docs/*.md points at a file that exists (and, with a
`#fragment`, at one of that file's headings)."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import REPO, python_blocks, run_page_code

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
# [text](target) and ![alt](target), outside code blocks and code spans.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")

# What the README's block claims, checked after it ran in the same process.
CLAIMS = """
import os
import numpy as np
assert step == 7, step
assert np.array_equal(restored["params"], state["params"])
assert np.array_equal(jax.random.key_data(restored["rng"]), jax.random.key_data(state["rng"]))
assert type(restored["step"]) is int and restored["step"] == 7
assert os.path.isdir(os.path.join(CKPT, "7", "train", "part_00000")), "release_memory persisted"
mngr.close()
print("README OK")
"""


def test_the_readme_example_runs(tmp_path):
    blocks = python_blocks(README)
    assert len(blocks) == 1, "the README has one example"
    assert len(blocks[0].splitlines()) <= 15, "the README's example is at most 15 lines"
    ckpt = str(tmp_path / "ckpt")
    # The README's directories are /dev/shm/jaxckpt and /tmp/ckpt; this run keeps its own.
    code = (
        blocks[0]
        .replace('"/dev/shm/jaxckpt"', repr(str(tmp_path / "memory")))
        .replace('"/tmp/ckpt"', repr(ckpt))
    )
    assert ckpt in code and str(tmp_path / "memory") in code, "the README's paths changed"
    proc = run_page_code(f"CKPT = {ckpt!r}\n{code}\n{CLAIMS}", tmp_path, timeout=120)
    assert "README OK" in proc.stdout


def strip_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def strip_code(text: str) -> str:
    return re.sub(r"`[^`\n]*`", "", strip_blocks(text))


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", strip_blocks(page.read_text()), flags=re.M)
    return {anchor(h) for h in headings}


def test_every_relative_link_resolves():
    assert len(PAGES) > 5
    broken = []
    for page in PAGES:
        for target in LINK.findall(strip_code(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            name = f"{page.relative_to(REPO)}: {target}"
            if not dest.exists():
                broken.append(f"{name} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{name} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_stays_short():
    assert len(README.read_text(encoding="utf-8")) <= 8000
