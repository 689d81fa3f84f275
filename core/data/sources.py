"""Documents from text, JSONL and Parquet files, cut into independent work units for parallel preparation.

- text (any other suffix): the whole file is one document;
- JSONL (``.jsonl``/``.ndjson``): one JSON object per line, the document is its ``text_field`` string; a file is
  split into byte ranges, and a line belongs to the range its first byte lies in, so ranges never share a line;
- Parquet (``.parquet``, needs pyarrow): the ``text_field`` column, one unit per row group.

With no files, the embedded corpus is the input (its chapters are the documents). Units are listed in file order,
so concatenating their outputs in order gives the same token file for any number of workers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from crosstrain.errors import ConfigError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
#: JSONL byte range per work unit: large enough that per-unit overhead vanishes, small enough to balance.
JSONL_UNIT_BYTES = 1 << 20


@dataclass(frozen=True)
class Unit:
    """A piece of one input: ``kind`` text (whole file), jsonl (byte range), parquet (row groups) or corpus (the
    embedded corpus, ``path`` empty)."""

    path: str
    kind: str
    start: int = 0
    end: int = 0


def file_kind(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def _parquet_file(path: str):  # type: ignore[no-untyped-def]
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow; pip install 'crosstrain[hf]'") from None
    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # ArrowInvalid is a ValueError
        raise ConfigError(f"{path} is not a Parquet file ({exc}); give it another suffix if it is text, or "
                          "convert it") from None


def plan_units(paths: list[str]) -> list[Unit]:
    """Work units for ``paths`` in order (JSONL files split into ``JSONL_UNIT_BYTES`` ranges)."""
    units: list[Unit] = []
    for path in paths:
        if not Path(path).is_file():
            raise ConfigError(f"input file {path!r} does not exist")
        kind = file_kind(path)
        if kind == "jsonl":
            size = os.path.getsize(path)
            step = JSONL_UNIT_BYTES
            units += [Unit(path, kind, s, min(s + step, size)) for s in range(0, size, step)] or [Unit(path, kind)]
        elif kind == "parquet":
            groups = _parquet_file(path).num_row_groups
            units += [Unit(path, kind, g, g + 1) for g in range(groups)]
        else:
            units.append(Unit(path, kind))
    return units


def _jsonl(unit: Unit, field: str) -> Iterator[str]:
    with open(unit.path, "rb") as fh:
        pos = unit.start
        if pos > 0:  # a line that started before this range belongs to the previous unit
            fh.seek(pos - 1)
            if fh.read(1) != b"\n":
                pos += len(fh.readline())
        fh.seek(pos)
        while pos < unit.end:
            line = fh.readline()
            if not line:
                break
            where = pos
            pos += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[field]
            except ValueError:
                raise ConfigError(f"{unit.path}: the line at byte {where} is not JSON") from None
            except (KeyError, TypeError):
                raise ConfigError(f"{unit.path}: the record at byte {where} has no {field!r} field; name the text "
                                  "field with --text-field") from None
            if not isinstance(text, str):
                raise ConfigError(f"{unit.path}: {field!r} at byte {where} is {type(text).__name__}, not a string")
            yield text


def _parquet(unit: Unit, field: str) -> Iterator[str]:
    pf = _parquet_file(unit.path)
    if field not in pf.schema_arrow.names:
        raise ConfigError(f"{unit.path} has no column {field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                          "name the text column with --text-field")
    import pyarrow as pa

    kind = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):  # as JSONL refuses a non-string field
        raise ConfigError(f"{unit.path}: column {field!r} holds {kind}, not strings; name the text column with "
                          "--text-field")
    for g in range(unit.start, unit.end):
        for text in pf.read_row_group(g, columns=[field]).column(field).to_pylist():
            if text is not None:
                yield text


def iter_documents(unit: Unit, field: str = "text") -> Iterator[str | bytes]:
    """The documents of one unit, in order. Text files come as raw bytes, so the byte tokenizer keeps them exactly
    (tokenizers that need text decode them as UTF-8, replacing invalid bytes)."""
    if unit.kind == "corpus":
        yield from corpus_documents()
    elif unit.kind == "jsonl":
        yield from _jsonl(unit, field)
    elif unit.kind == "parquet":
        yield from _parquet(unit, field)
    else:
        yield Path(unit.path).read_bytes()


def corpus_documents() -> list[str]:
    """The embedded corpus as documents: its chapters, without the blank lines that end each one."""
    from crosstrain.data.corpus import corpus_bytes
    from crosstrain.data.split import corpus_document_starts

    text = corpus_bytes()
    starts = [int(s) for s in corpus_document_starts(text)] + [len(text)]
    return [text[a:b].decode("ascii").rstrip("\n") for a, b in zip(starts[:-1], starts[1:], strict=True)]
