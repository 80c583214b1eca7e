"""An MkDocs hook: a link from a page to something of the repository that is not in
the site (a source file such as `../scripts/bench.py`, a folder, a file that
`exclude_docs` leaves out) becomes its text, so a page reads the same on GitHub and in
the site, and `mkdocs build --strict` still fails on a link to a missing page. A link
whose target is not on disk is left for MkDocs to report."""

import pathlib
import re

# [text](target#anchor), not an image (`![...]`).
_LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown, page, config, files):
    docs = pathlib.Path(config["docs_dir"]).resolve()
    here = (docs / page.file.src_uri).parent
    excluded = config["exclude_docs"]

    def in_site(target: pathlib.Path) -> bool:
        if target.is_dir() or not target.is_relative_to(docs):
            return False
        rel = target.relative_to(docs).as_posix()
        return excluded is None or not excluded.match_file(rel)

    def unlink(match):
        text, href = match.group(1), match.group(2)
        if "://" in href or href.startswith(("/", "mailto:")):
            return match.group(0)
        target = (here / href).resolve()
        if target.exists() and not in_site(target):
            return text
        return match.group(0)

    return _LINK.sub(unlink, markdown)
