"""A progress bar: tqdm when installed, else a one-line bar on stderr."""

from __future__ import annotations

import sys


class _SimpleBar:
    def __init__(self, total: int, stream=None, width: int = 30):
        self.total, self.done, self.width = total, 0, width
        self.stream = stream or sys.stderr
        self._last_len = 0

    def set_description(self, text: str) -> None:
        self._draw(text)

    def update(self, n: int = 1) -> None:
        self.done += n
        self._draw("")

    def _draw(self, text: str) -> None:
        filled = self.width * self.done // max(self.total, 1)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {text}"
        pad = max(self._last_len - len(line), 0)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._last_len = len(line)

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def progress_bar(total: int, enabled: bool = True):
    """Returns an object with set_description(text), update(n) and close()."""
    if not enabled:
        return _SilentBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _SimpleBar(total)
    return tqdm(total=total, unit="run", dynamic_ncols=True)


class _SilentBar:
    def set_description(self, text: str) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass
