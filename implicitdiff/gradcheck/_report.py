"""The results of `check_grads` and their table.

`GradCheckRow` is one comparison, `GradCheckError` the assertion that carries every row
when one fails, and `format_table` renders rows as aligned plain text or Markdown (the
command line adds a leading problem column).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["GradCheckRow", "GradCheckError", "format_table"]


@dataclasses.dataclass(frozen=True)
class GradCheckRow:
    """One comparison made by `check_grads`.

    Attributes:
        argument: the argument that was perturbed: its parameter name when `f`'s
            signature gives one, else ``"args[i]"``; ``"all"`` for the value row and
            when every argument was perturbed at once (``per_argument=False``).
        mode: ``"fwd"`` (jvp), ``"rev"`` (vjp) or ``"value"``; at order 2 and above
            the composition, outermost first, e.g. ``"fwd-over-rev"`` is the jvp of the
            vjp function.
        order: derivative order (0 for the value row).
        against: what it was compared with: ``"finite differences"``, ``"reference"``
            or ``"jvp"`` (a vjp checked against the jvp by <u, J v> = <J^T u, v>).
        max_abs_err: largest absolute difference.
        max_rel_err: `max_abs_err` divided by the scale of the expected values
            (their largest magnitude; for the <u, J v> identity, sum |u| |J v|).
        tol: the threshold `max_abs_err` was compared with: atol + rtol * scale.
        passed: whether ``max_abs_err <= tol`` (False for NaN).
    """

    argument: str
    mode: str
    order: int
    against: str
    max_abs_err: float
    max_rel_err: float
    tol: float
    passed: bool


class GradCheckError(AssertionError):
    """Raised by `check_grads` when a check fails; `rows` holds every result row."""

    def __init__(self, message: str, rows: Sequence[GradCheckRow]):
        super().__init__(message)
        self.rows: list[GradCheckRow] = list(rows)

    def __reduce__(self):  # picklable despite the extra constructor argument
        return (type(self), (str(self), self.rows))


_HEADERS = (
    "argument",
    "mode",
    "order",
    "against",
    "max abs error",
    "max rel error",
    "tolerance",
    "status",
)
_NUMERIC = {"order", "max abs error", "max rel error", "tolerance"}


def _fmt_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    return f"{x:.2e}"


def format_table(
    rows: Sequence[GradCheckRow],
    *,
    markdown: bool = False,
    problems: Sequence[str] | None = None,
) -> str:
    """Render result rows as a table.

    Arguments:
        rows: the rows returned by `check_grads` (or carried by `GradCheckError`).
        markdown: a Markdown table instead of aligned plain text.
        problems: optional problem names, one per row, shown in a leading
            ``problem`` column (the command line uses this).

    Returns:
        The table as a string without a trailing newline. The status column reads
        ``ok`` or ``FAIL``; in plain text, failing rows also start with ``>``.

    Example:
        ```python
        from implicitdiff.gradcheck import GradCheckRow, format_table

        row = GradCheckRow("x", "fwd", 1, "finite differences", 1e-9, 1e-9, 1e-5, True)
        print(format_table([row], markdown=True))
        ```
    """
    if problems is not None and len(problems) != len(rows):
        raise ValueError(f"got {len(problems)} problem names for {len(rows)} rows")
    headers = list(_HEADERS)
    if problems is not None:
        headers.insert(0, "problem")
    body = []
    for i, r in enumerate(rows):
        cells = [
            r.argument,
            r.mode,
            str(r.order),
            r.against,
            _fmt_float(r.max_abs_err),
            _fmt_float(r.max_rel_err),
            _fmt_float(r.tol),
            "ok" if r.passed else "FAIL",
        ]
        if problems is not None:
            cells.insert(0, problems[i])
        body.append(cells)
    right = [h in _NUMERIC for h in headers]

    if markdown:
        esc = lambda s: s.replace("|", "\\|")
        lines = ["| " + " | ".join(headers) + " |"]
        lines.append("|" + "|".join("---:" if r else "---" for r in right) + "|")
        lines += ["| " + " | ".join(esc(c) for c in cells) + " |" for cells in body]
        return "\n".join(lines)

    widths = [max([len(h), *(len(c[j]) for c in body)]) for j, h in enumerate(headers)]

    def line(cells: Sequence[str], mark: str) -> str:
        parts = [
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        ]
        return (mark + "  ".join(parts)).rstrip()

    out = [line(headers, "  "), "  " + "  ".join("-" * w for w in widths)]
    out += [line(cells, "  " if cells[-1] == "ok" else "> ") for cells in body]
    return "\n".join(out)
