"""How commands are packed for the wire: big values unjoined, everything else in C.

redis-py picks one packer per connection. With hiredis installed it packs in C, which
is fast for many small arguments (an ``EXISTS`` batch) but copies every value twice
(a memoryview becomes ``bytes``, then the whole command is joined). Its Python packer
sends memoryviews as they are, but joins its growing buffer once per argument, which
costs more than the network for a batch of small keys, and sends each value with its
own ``sendall``. So: a command carrying a value of :data:`SEND_AS_IS` bytes or more goes
through the Python packer (the page leaves from the caller's memory); any other through
hiredis's, when installed.
"""

from __future__ import annotations

from typing import Any

from redis.connection import (  # type: ignore[attr-defined]
    Encoder,
    HiredisRespSerializer,
    PythonRespSerializer,
)
from redis.utils import HIREDIS_AVAILABLE

__all__ = ["SEND_AS_IS", "Packer"]

#: Values this big are sent from the caller's buffer; a copy of smaller ones costs less
#: than the extra system call per value.
SEND_AS_IS = 64 * 1024
_CUTOFF = 6000  # redis-py's own: pieces below this are joined into one send


class Packer:
    """A redis-py command packer (``command_packer=``) choosing per command; see above."""

    def __init__(self) -> None:
        encode = Encoder("utf-8", "strict", False).encode  # type: ignore[no-untyped-call]
        self._as_is = PythonRespSerializer(_CUTOFF, encode)
        # typed in redis-py 8.1, untyped in 8.2
        self._small = HiredisRespSerializer() if HIREDIS_AVAILABLE else self._as_is  # type: ignore[no-untyped-call]

    def pack(self, *args: Any) -> list[Any]:
        for arg in args:
            if isinstance(arg, memoryview) and arg.nbytes >= SEND_AS_IS:
                return self._as_is.pack(*args)  # type: ignore[no-any-return,no-untyped-call]
        return self._small.pack(*args)  # type: ignore[no-any-return,no-untyped-call]
