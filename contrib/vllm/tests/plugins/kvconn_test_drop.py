"""A real third-party kvconn backend, found through its entry point, for one test.

LMDB, except that when the file ``drop-next-load`` exists in the store directory the
next load first deletes the second page it asks for (and the file): a page evicted
between the scheduler's lookup and the worker's load, in vLLM's own worker process.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvconn_lmdb import LmdbBackend

MARKER = "drop-next-load"


class DropOnLoadBackend(LmdbBackend):
    name = "lmdb-drop-on-load"

    def _get(self, keys: list[str], buffers: list[memoryview], *, scratch: bool) -> Sequence[bool]:
        marker = self.path / MARKER
        if len(keys) > 1 and marker.exists():
            marker.unlink()
            self._delete([keys[1]])
        return super()._get(keys, buffers, scratch=scratch)
