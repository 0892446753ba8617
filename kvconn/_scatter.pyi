from collections.abc import Sequence

from typing_extensions import Buffer

def scatter_pages(pages: Sequence[tuple[Buffer, int, int, bytes]], /) -> None: ...
