"""Reading a small text file whole, with an error that names the file, the line and the fix."""

from __future__ import annotations


def read_utf8(path: str, error: type[Exception] = ValueError, fix: str = "save the file as UTF-8") -> str:
    """The text of ``path`` (UTF-8; a byte-order mark is accepted and dropped).

    Raises:
      error: ``path:line: not valid UTF-8; <fix>`` when the bytes are not UTF-8.
      OSError: the file cannot be read (the CLI turns it into one line naming the path).
    """
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise error(f"{path}:{line}: not valid UTF-8; {fix}") from None
