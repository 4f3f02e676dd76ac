"""Reading what `kubectl get` prints: its table, cut at the header's column offsets so that
empty cells stay in place."""


def table(output: str) -> tuple[list[str], list[list[str]]]:
    """kubectl's header and rows, cells cut at the header's column offsets."""
    header, *lines = output.rstrip("\n").splitlines()
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    bounds = [*starts[1:], None]
    rows = [[line[a:b].strip() for a, b in zip(starts, bounds, strict=True)] for line in lines]
    return header.split(), rows


def cells(output: str) -> list[list[str]]:
    """The rows of kubectl's table (the header left out), empty cells in place."""
    return table(output)[1]
