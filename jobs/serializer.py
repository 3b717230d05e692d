"""msgpack for everything prefillq and RQ store in Redis. Never pickle: anyone who can write
Redis would get code execution in the worker."""

from __future__ import annotations

from typing import Any

import msgpack

# What decoding bytes that anyone could have written raises, from msgpack itself (its errors
# are ValueErrors) to the shape checks after it: a corrupt value, not a bug of ours.
DECODE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError)


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class MsgpackSerializer:
    """RQ serializer (``Queue(serializer=MsgpackSerializer)``).

    RQ stores ``(func_name, instance, args, kwargs)``; msgpack returns the tuple as a list,
    which RQ unpacks positionally, so the round trip holds for ids and primitives.
    """

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return packb(obj)

    @staticmethod
    def loads(data: bytes) -> Any:
        return unpackb(data)
