"""Bad-row accounting shared by the row readers (JSONL lines, parquet and `datasets` rows): an
empty row is skipped and counted; a *bad* one (no text field, or not a string) too, up to
`max_bad_rows`, the next stopping the read with an InputError naming its file and row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scse_dist.cli_errors import InputError


@dataclass
class RowStats:
    """Counts of the rows read; `check` applies the limit. One instance spans every input."""

    max_bad_rows: int = 0
    rows: int = 0
    empty: int = 0
    bad: int = 0
    first_bad: list[str] = field(default_factory=list)  # where and why, the first few

    def take(self, value: object, where: str, text_field: str, missing: str | None = None
             ) -> str | None:
        """The row's text, or None when it is skipped (empty, or bad within the limit).
        `missing`: the row has no such field; the text says what it has (named in the error)."""
        self.rows += 1
        if missing is not None:
            self._bad(where, f"no field {text_field!r} ({missing})")
            return None
        if not isinstance(value, str):
            what = "null" if value is None else type(value).__name__
            self._bad(where, f"field {text_field!r} is {what}, expected a string")
            return None
        if not value.strip():
            self.empty += 1
            return None
        return value

    def _bad(self, where: str, why: str) -> None:
        self.bad += 1
        if len(self.first_bad) < 3:
            self.first_bad.append(f"{where}: {why}")
        if self.bad > self.max_bad_rows:
            raise InputError(f"{where}: {why}; {self.bad} bad row{'s' if self.bad > 1 else ''} "
                             f"so far, over --max-bad-rows {self.max_bad_rows} (raise it to skip "
                             "them)")

    def summary(self) -> str:
        """For the command's last line: '' when no row was skipped."""
        if not (self.empty or self.bad):
            return ""
        first = f" (first: {self.first_bad[0]})" if self.first_bad else ""
        return (f"; skipped {self.empty:,} empty and {self.bad:,} bad rows of {self.rows:,}"
                f"{first}")
