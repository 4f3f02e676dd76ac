"""A terminal for tests of what a person sees: a stream that says it is one (so progress
bars are drawn on it) and the rows it would show."""

import io


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal: Progress draws bars on it, as on a person's."""

    def isatty(self) -> bool:
        return True


def screen(written: str) -> list[str]:
    """The rows a terminal shows after `written`: a carriage return goes to the row's start,
    a newline to the next row, ESC [ A up a row; characters overwrite what is there. Any other
    escape sequence fails the test (this would not show it as a terminal does)."""
    rows: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(written):
        if written.startswith("\x1b[A", i):
            row, i = max(0, row - 1), i + 3
            continue
        char = written[i]
        i += 1
        assert char != "\x1b", f"an escape sequence the emulator does not know: {written[i:]!r}"
        if char == "\r":
            col = 0
        elif char == "\n":
            row, col = row + 1, 0
            rows += [[] for _ in range(row + 1 - len(rows))]
        else:
            line = rows[row]
            line += [" "] * (col + 1 - len(line))
            line[col] = char
            col += 1
    return ["".join(r).rstrip() for r in rows]
