"""`jobs.prefixes`: block keys that name one prefix of one model's cache in every process
(the client's routing and the worker's prefix cache compute them alike), and the blocks that
carry routing entries."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobs.prefixes import block_keys, root_key, route_blocks, salted


def test_a_prompts_keys_chain_its_whole_blocks():
    root = root_key("ab" * 32, {"layers": [[1, 16, None]]})
    ids = list(range(100))
    keys = block_keys(ids, root, 32)
    assert len(keys) == 3 and len(set(keys)) == 3  # the last 4 ids make no block
    assert block_keys(ids[:64], root, 32) == keys[:2]  # a prefix's keys prefix the prompt's
    assert block_keys(ids[:31], root, 32) == []
    other = block_keys([7, *ids[1:]], root, 32)  # one id changed: every key after it too
    assert all(a != b for a, b in zip(keys, other, strict=True))
    with pytest.raises(ValueError, match="block_tokens"):
        block_keys(ids, root, 0)


def test_the_root_names_the_model_file_the_cache_layout_and_the_salt():
    layout = {"kv_dtype": "float32", "layers": [[1, 16, 16]]}
    base = root_key("0" * 64, layout)
    assert base == root_key("0" * 64, dict(reversed(layout.items())))  # key order aside
    assert salted(base, None) == base
    assert salted(base, "tenant-a") == salted(root_key("0" * 64, layout), "tenant-a")
    assert len({base, root_key("1" * 64, layout), salted(base, "tenant-a"),
                salted(base, "tenant-b"), root_key("0" * 64, {**layout, "kv_dtype": "bfloat16"}),
                }) == 5
    assert all(len(k) == 16 for k in (base, salted(base, "x")))


def test_keys_are_the_same_in_another_process():
    code = ("from jobs.prefixes import block_keys, root_key;"
            "print(' '.join(k.hex() for k in block_keys(range(70), root_key('f' * 64, {}), 32)))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.split()
    assert there == [k.hex() for k in block_keys(range(70), root_key("f" * 64, {}), 32)]


def test_routing_entries_mark_doubling_prefixes_and_the_last_block():
    assert route_blocks(0) == []
    assert route_blocks(1) == [0]
    assert route_blocks(5) == [0, 1, 3, 4]
    assert route_blocks(8) == [0, 1, 3, 7]
    assert route_blocks(100) == [0, 1, 3, 7, 15, 31, 63, 99]
