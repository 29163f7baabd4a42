"""Measured schedule tables: which schedule ``cutedsl`` runs on one GPU model, per problem.

``tools/kda tune`` sweeps the candidate schedules for each (state dtype, T, heads, batch) on
the GPU it runs on, beside ``touch`` in one process, and writes the winners as a table keyed
by the device's name (``tables/<name>.json`` in this package; as vLLM ships per-device
kernel configs). A GPU with a table runs it (:func:`for_device`); any other gets the default
in SM waves (:mod:`kda.backends.cutedsl.policy`). ``python3 -m kda`` says which is in use.

Each row keeps its evidence: the step time of every candidate measured and of ``touch`` in
the same run, and the table names the results file it came from. A lookup
(:meth:`Table.axes_for`) takes the rows of the call's state dtype and T (a T the table has
not measured: the default decides), of the measured head count nearest the call's and of the
measured item count nearest the call's (both on a log scale; ties: the smaller); where that
row's schedule cannot serve the problem the default decides too.

Pure Python (no CuTe DSL import).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from fractions import Fraction
from typing import Dict, List, Optional, Tuple

#: The folder of the shipped tables.
TABLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tables")
#: The format of a table file (written as ``"format"``; a file of another is not read).
FORMAT = 1


def slug(device_name: str) -> str:
    """The file name stem of a device's table: its name lower-cased, runs of anything but
    letters and digits as one ``-`` (``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``)."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured cell: the winning schedule's axes (:meth:`Schedule.axes`) and the step times
    (us) of every candidate and of ``touch`` in the same run."""
    state: str
    T: int
    heads: int
    items: int
    axes: Tuple[Tuple[str, object], ...]
    times: Tuple[Tuple[str, float], ...]
    touch_us: float

    @property
    def schedule(self) -> dict:
        return dict(self.axes)

    def to_json(self) -> dict:
        return {"state": self.state, "T": self.T, "heads": self.heads, "items": self.items,
                "schedule": dict(self.axes), "us": dict(self.times), "touch_us": self.touch_us}

    @classmethod
    def from_json(cls, d: dict) -> "Row":
        """The row of ``d``; ValueError naming what is out of range (a state dtype, T, heads,
        items, a schedule that is not one, no times)."""
        from kda.backends.cutedsl.problem import MAX_T
        from kda.backends.cutedsl.schedule import Schedule

        row = cls(state=d["state"], T=int(d["T"]), heads=int(d["heads"]), items=int(d["items"]),
                  axes=tuple(sorted(d["schedule"].items())),
                  times=tuple(sorted((k, float(v)) for k, v in d["us"].items())),
                  touch_us=float(d["touch_us"]))
        why = []
        if row.state not in ("fp32", "bf16"):
            why.append(f"state: expected fp32 or bf16, got {row.state!r}")
        if not 1 <= row.T <= MAX_T:
            why.append(f"T: expected 1..{MAX_T}, got {row.T}")
        if row.heads < 1 or row.items < 1:
            why.append(f"heads, items: expected >= 1, got {row.heads}, {row.items}")
        if not row.times or row.touch_us <= 0:
            why.append("us, touch_us: expected step times")
        try:
            Schedule(**row.schedule)
        except (TypeError, ValueError) as e:
            why.append(f"schedule {row.schedule}: {e}")
        if why:
            raise ValueError(f"row {d}: {'; '.join(why)}")
        return row


def _nearest(values, want: int) -> int:
    """The value of ``values`` nearest ``want`` on a log scale, by the exact ratio of the
    larger to the smaller (ties: the smaller value)."""
    return min(values, key=lambda v: (Fraction(max(v, want), min(v, want)), v))


@dataclasses.dataclass(frozen=True)
class Table:
    """The measured table of one GPU model (module docstring)."""
    device: str
    sms: int
    source: str
    rows: Tuple[Row, ...]
    meta: Tuple[Tuple[str, object], ...] = ()

    def _rows(self, T: int, state_bf16: bool, heads: int) -> List[Row]:
        state = "bf16" if state_bf16 else "fp32"
        rows = [r for r in self.rows if r.state == state and r.T == T]
        if not rows:
            return []
        h = _nearest({r.heads for r in rows}, heads)
        return [r for r in rows if r.heads == h]

    def axes_for(self, items: int, T: int, state_bf16: bool, heads: int) -> Optional[dict]:
        """The schedule axes of the row nearest the call (module docstring), None if the
        table has no row of the state dtype and T."""
        rows = self._rows(T, state_bf16, heads)
        if not rows:
            return None
        n = _nearest({r.items for r in rows}, max(items, 1))
        return next(r.schedule for r in rows if r.items == n)

    def all_axes(self, T: int, state_bf16: bool, heads: int) -> List[dict]:
        """Every schedule :meth:`axes_for` may return for this T, dtype and head count, in
        item order, each once."""
        out = []
        for r in sorted(self._rows(T, state_bf16, heads), key=lambda r: r.items):
            if r.schedule not in out:
                out.append(r.schedule)
        return out

    def to_json(self) -> dict:
        return {"format": FORMAT, "device": self.device, "sms": self.sms, "source": self.source,
                **dict(self.meta), "rows": [r.to_json() for r in self.rows]}

    @classmethod
    def from_json(cls, d: dict) -> "Table":
        if d.get("format") != FORMAT:
            raise ValueError(f"table format: expected {FORMAT}, got {d.get('format')!r}")
        meta = tuple(sorted((k, v) for k, v in d.items()
                            if k not in ("format", "device", "sms", "source", "rows")))
        return cls(device=d["device"], sms=int(d["sms"]), source=d["source"],
                   rows=tuple(Row.from_json(r) for r in d["rows"]), meta=meta)

    def dump(self, path: str) -> None:
        """Write the table as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")


_loaded: Dict[str, Optional[Table]] = {}


def path_for(device_name: str, table_dir: str = TABLE_DIR) -> str:
    """Where the table of ``device_name`` lives."""
    return os.path.join(table_dir, slug(device_name) + ".json")


def for_device(device_name: str, table_dir: str = TABLE_DIR) -> Optional[Table]:
    """The shipped table of ``device_name``, or None (the default in SM waves decides there).

    Raises:
      ValueError: a table file that cannot be read (a packaging error, not a fallback).
    """
    path = path_for(device_name, table_dir)
    if path not in _loaded:
        table = None
        if os.path.exists(path):
            try:
                with open(path) as f:
                    table = Table.from_json(json.load(f))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"cutedsl schedule table {path}: {type(e).__name__}: {e}") \
                    from None
        _loaded[path] = table
    return _loaded[path]


def shipped() -> List[str]:
    """The device names of the tables in the package."""
    out = []
    if os.path.isdir(TABLE_DIR):
        for name in sorted(os.listdir(TABLE_DIR)):
            if name.endswith(".json"):
                with open(os.path.join(TABLE_DIR, name)) as f:
                    out.append(json.load(f).get("device", name[:-5]))
    return out


def describe(device_name: Optional[str], sms: Optional[int] = None) -> str:
    """One line for ``python3 -m kda`` and the logs: which table ``cutedsl`` uses on
    ``device_name`` (None: no GPU) of ``sms`` multiprocessors (a table measured on another
    count is not used)."""
    have = ", ".join(shipped()) or "none"
    if device_name is None:
        return (f"cutedsl schedules: no GPU here (measured tables in the package: {have}; "
                f"any other GPU runs the default in SM waves)")
    table = for_device(device_name)
    if table is None:
        return (f"cutedsl schedules on {device_name}: the default in SM waves (no measured "
                f"table for this GPU; tables in the package: {have})")
    if sms is not None and sms != table.sms:
        return (f"cutedsl schedules on {device_name}: the default in SM waves (its table was "
                f"measured on {table.sms} SMs, this GPU has {sms})")
    return (f"cutedsl schedules on {device_name}: the measured table "
            f"{os.path.relpath(path_for(device_name), os.path.dirname(TABLE_DIR))} "
            f"({len(table.rows)} rows, from {table.source})")
