"""The embeddings file format: a gallery's item ids, labels and old / new / adapted vectors
in parquet (docs/simulator.md, "Input format"), read whole into a :class:`GalleryEmbeddings`
(``gallery``), streamed by row group as a :class:`ParquetGallery` (``dataset``), checked
column by column with errors that name the file and column (``format``), and the
fixed-size-list vector columns every writer uses (``vector_parquet``).
"""

import importlib

_EXPORTS = {
    "BackfillInputError": "format",
    "EmbeddingsParquet": "format",
    "GalleryEmbeddings": "gallery",
    "load_parquet": "gallery",
    "ParquetGallery": "dataset",
}


def __getattr__(name):
    """Lazy exports: importing the package stays light (no torch) until a name is used."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
