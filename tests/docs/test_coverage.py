"""Every runnable block (``sh``, ``bash``, ``python``) of the README and docs/ is run by a
test (its page is in a session of `tests.docs.examples.SESSIONS`) or named in `NOT_RUN` with
its reason: a new block that neither runs nor says why fails here."""

from __future__ import annotations

from tests.docs.examples import NOT_RUN, PAGES, SESSIONS, page_blocks

MAX_NOT_RUN = 6  # the exceptions stay few: an example that cannot run should say why here
RUN_PAGES = {page for pages in SESSIONS.values() for page in pages}


def test_every_runnable_block_is_run_or_listed_with_its_reason():
    unrun = [f"{b.page}:{b.line} {b.first_line!r}" for page in PAGES for b in page_blocks(page)
             if b.runnable and page not in RUN_PAGES and (b.page, b.first_line) not in NOT_RUN]
    assert not unrun, "blocks no test runs (add the page to a session, or to NOT_RUN):\n" + \
        "\n".join(unrun)


def test_not_run_is_short_and_names_existing_blocks():
    assert len(NOT_RUN) <= MAX_NOT_RUN
    blocks = {(b.page, b.first_line) for page in PAGES for b in page_blocks(page) if b.runnable}
    assert not set(NOT_RUN) - blocks, "NOT_RUN names blocks that are gone"
    assert all(reason.strip() for reason in NOT_RUN.values())


def test_each_page_runs_in_one_session_at_most():
    pages = [page for pages in SESSIONS.values() for page in pages]
    assert len(pages) == len(set(pages)) and set(pages) <= set(PAGES)
