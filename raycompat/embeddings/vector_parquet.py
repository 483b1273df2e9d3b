"""How embedding columns are stored in parquet: plain float32 pages, no compression, no
dictionary, no statistics (docs/architecture.md, "Formats": "Embeddings parquet").

Embeddings barely compress (snappy saves about 1 % of float32 vectors) and never repeat, so
compressing them and trying a dictionary only costs time: a reader decodes plain pages 5-10 %
faster on one thread (``bench/vector_pages.py``; docs/benchmarks.md, "Reading row groups").
Every other column keeps pyarrow's defaults (snappy, dictionary, statistics).
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_vector_type", "write_options"]


def is_vector_type(t) -> bool:
    """Whether an arrow type is an embedding: a (fixed-size) list of floating-point values."""
    import pyarrow as pa

    lists = pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)
    return lists and pa.types.is_floating(t.value_type)


def write_options(schema) -> dict[str, Any]:
    """Keyword arguments of ``pyarrow.parquet.write_table`` for a table of ``schema``: vector
    columns plain and uncompressed, the others as pyarrow writes them."""
    vectors = {f.name for f in schema if is_vector_type(f.type)}
    others = [f.name for f in schema if f.name not in vectors]
    return {
        "compression": {f.name: ("none" if f.name in vectors else "snappy") for f in schema},
        "use_dictionary": others,
        "write_statistics": others,
    }
