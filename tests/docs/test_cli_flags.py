"""Every ``prefillq`` flag the README and docs/ show exists in the CLI's argparse: a flag
after ``prefillq COMMAND`` (in a code block or an inline span) is one of that command's, and
an inline span that is a flag alone (```--session-slots N```) is one of some command's."""

from __future__ import annotations

import argparse
import re

import pytest

from tests.docs.examples import PAGES, ROOT
from worker.cli import build_parser

FENCE = re.compile(r"^( *)```\w*\n(.*?)^\1```$", re.S | re.M)
SPAN = re.compile(r"``(.+?)``|`([^`]+)`", re.S)  # a span may wrap a line
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
# where a command's flags end: the shell's operators, a redirect, a comment
ENDS = re.compile(r"^(&&?|;|\|\||[0-9]?>.*|#.*|\$\(.*)$")
# flags of other tools that prose names alone, beside the command it names
FOREIGN = {"--retry-connrefused": "curl", "--profile": "docker compose",
           "--models": "python -m bench.gpu", "--ratios-only": "python -m bench"}


def command_flags() -> dict[str, set[str]]:
    """Each ``prefillq`` subcommand's option strings, ``--help`` included."""
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: set(parser._option_string_actions) for name, parser in sub.choices.items()}


def shown_commands(text: str) -> list[tuple[str, list[str]]]:
    """Each ``prefillq COMMAND`` in `text` (lines joined at a trailing backslash) with the
    flags after it, up to a shell operator, a comment or the next ``prefillq``; COMMAND may
    be several joined by ``|`` (``status|cancel|result``)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        tokens = line.split()
        for i, token in enumerate(tokens[:-1]):
            if not re.fullmatch(r"(\S*/)?prefillq", token):
                continue
            names, flags = tokens[i + 1], []
            for arg in tokens[i + 2:]:
                if ENDS.match(arg) or re.fullmatch(r"(\S*/)?prefillq", arg):
                    break
                flags += FLAG.findall(arg)
            found += [(name, flags) for name in names.split("|")]
    return found


def texts(page: str) -> tuple[list[str], list[str]]:
    """`page`'s code blocks and its prose's inline code spans."""
    text = (ROOT / page).read_text()
    prose = FENCE.sub("", text)
    spans = [(m.group(1) or m.group(2)).replace("\n", " ") for m in SPAN.finditer(prose)]
    return [m.group(2) for m in FENCE.finditer(text)], spans


@pytest.mark.parametrize("page", PAGES)
def test_every_flag_after_a_prefillq_command_is_that_commands(page):
    known = command_flags()
    blocks, spans = texts(page)
    wrong = []
    for text in [*blocks, *spans]:
        for name, flags in shown_commands(text):
            if not re.fullmatch(r"[a-z]+", name):
                continue  # `prefillq` as a word (`prefillq[worker]`, "prefillq only prefills")
            if name not in known:
                wrong.append(f"prefillq {name}")
            wrong += [f"prefillq {name} {f}" for f in flags if f not in known.get(name, ())]
    assert not wrong, wrong


@pytest.mark.parametrize("page", [p for p in PAGES if p != "docs/benchmarks.md"])
def test_every_flag_named_alone_is_a_prefillq_flag(page):
    every = set().union(*command_flags().values())
    _, spans = texts(page)
    alone = {f for span in spans if span.startswith("--") for f in FLAG.findall(span)}
    assert not alone - every - set(FOREIGN), sorted(alone - every - set(FOREIGN))
