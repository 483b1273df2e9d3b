"""Ray Data gallery embedding pipeline: sources -> render/decode -> preprocess ->
old / new embedder pools -> psi and uncertainty -> resumable parquet shards.

The library call is :func:`embed_gallery`; :mod:`raycompat.pipeline.job` is its command line
(``raycompat embed-gallery``, ``jobs/embed_gallery.py``).
"""

from raycompat.data.item_source import ItemSource
from raycompat.data.parquet_images import ParquetImageSource
from raycompat.pipeline.bundles import make_random_bundles
from raycompat.pipeline.ids import IdPlan
from raycompat.pipeline.job import EmbedGalleryOptions, GalleryRun, embed_gallery, main
from raycompat.pipeline.options import ExecutionOptions, PipelineOptions, StageOptions
from raycompat.pipeline.sources import (
    EXTRA_INSTANCE_BASE,
    GlyphGallerySource,
    OldFeatureSource,
    RecordSource,
)

__all__ = [
    "embed_gallery",
    "GalleryRun",
    "main",
    "EmbedGalleryOptions",
    "PipelineOptions",
    "ExecutionOptions",
    "StageOptions",
    "IdPlan",
    "ItemSource",
    "GlyphGallerySource",
    "OldFeatureSource",
    "RecordSource",
    "ParquetImageSource",
    "EXTRA_INSTANCE_BASE",
    "make_random_bundles",
]
