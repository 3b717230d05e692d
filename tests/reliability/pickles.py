"""Find pickle in what Redis holds, without unpickling anything: every value of every key
(strings, hash fields and values, list items, set and sorted-set members, stream entries),
also after undoing the zlib and base64 wrappings RQ puts around its payloads, is parsed with
`pickletools.genops`, which reads opcodes and never runs them."""

from __future__ import annotations

import base64
import binascii
import pickletools
import zlib

import redis

# The PROTO opcode: a pickle of protocol 2 or later starts with it and its protocol.
PROTO = 0x80
PICKLE_PROTOCOLS = range(2, 6)


def is_pickle(data: bytes) -> bool:
    """Whether `data` is a pickle stream `pickle.loads` would accept: its opcodes parse up
    to STOP, and it starts with a protocol 2-5 header (loads ignores what follows STOP) or,
    for protocols 0 and 1, STOP is its last byte."""
    if not data:
        return False
    try:
        ops = list(pickletools.genops(data))
    except Exception:  # an unknown opcode, a bad argument, or no STOP before the end
        return False
    _, _, stop_at = ops[-1]
    header = data[0] == PROTO and len(data) > 1 and data[1] in PICKLE_PROTOCOLS
    return header or stop_at == len(data) - 1


def unwrapped(data: bytes) -> list[bytes]:
    """`data` and what it holds under RQ's wrappings: zlib (a job's ``data``), base64
    (a result stream's ``return_value`` and ``exc_string``) and base64 of zlib."""
    found = [data]
    for candidate in (data, _b64(data)):
        if candidate is None:
            continue
        if candidate is not data:
            found.append(candidate)
        try:
            found.append(zlib.decompress(candidate))
        except zlib.error:
            pass
    return found


def _b64(data: bytes) -> bytes | None:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return None


def all_values(conn: redis.Redis) -> dict[str, list[bytes]]:
    """Every value in `conn`'s database by key (SCAN): hash fields and values, list items,
    set and sorted-set members, stream entry fields and values."""
    values: dict[str, list[bytes]] = {}
    for key in conn.scan_iter(count=1000):
        kind = conn.type(key)
        if kind == b"string":
            found = [conn.get(key)]
        elif kind == b"hash":
            found = [b for pair in conn.hgetall(key).items() for b in pair]
        elif kind == b"list":
            found = conn.lrange(key, 0, -1)
        elif kind == b"set":
            found = list(conn.smembers(key))
        elif kind == b"zset":
            found = conn.zrange(key, 0, -1)
        elif kind == b"stream":
            found = [b for _, entry in conn.xrange(key) for pair in entry.items() for b in pair]
        else:
            found = []  # gone between SCAN and TYPE
        values[key.decode()] = [v for v in found if v is not None]
    return values


def pickled(values: dict[str, list[bytes]]) -> list[tuple[str, bytes]]:
    """The (key, value) pairs of `values` that are, or wrap, a pickle stream."""
    return [(key, value[:40]) for key, found in values.items() for value in found
            if any(is_pickle(v) for v in unwrapped(value))]
