"""Data: the built-in glyph data set, upgrade scenarios, user-data readers, item sources
(images by item id: ``item_source``, ``parquet_images``) and PyTorch datasets. The
torch-based names (``GlyphDataset``, ``ImageRecordDataset``, ``collate_skip_none``,
``to_tensor``) are imported lazily, so building catalogs and scenarios does not import torch."""

from .glyphs import GlyphCatalog, GlyphRenderer, default_catalog
from .readers import (
    CorruptImageError,
    ImageRecord,
    RecordSet,
    RevisitedData,
    load_image,
    read_gldv2_csv,
    read_image_folder,
    read_parquet_images,
    read_revisited,
)
from .scenarios import (
    SCENARIOS,
    Scenario,
    ScenarioSizes,
    Split,
    build_scenario,
    catalog_for,
    format_allocation,
    scenario_from_options,
)
from .source import DataSourceOptions, ItemImages, LabelledItems, SourceSpec, list_items
from .user_scenarios import read_scenario_file, resolve_scenario, write_scenario_file

_LAZY = {"GlyphDataset", "ImageRecordDataset", "collate_skip_none", "images_to_tensor", "to_tensor"}

__all__ = [
    "GlyphCatalog",
    "GlyphRenderer",
    "default_catalog",
    "SCENARIOS",
    "Scenario",
    "ScenarioSizes",
    "Split",
    "build_scenario",
    "catalog_for",
    "format_allocation",
    "scenario_from_options",
    "CorruptImageError",
    "ImageRecord",
    "RecordSet",
    "RevisitedData",
    "load_image",
    "read_image_folder",
    "read_gldv2_csv",
    "read_revisited",
    "read_parquet_images",
    "DataSourceOptions",
    "ItemImages",
    "LabelledItems",
    "SourceSpec",
    "list_items",
    "read_scenario_file",
    "resolve_scenario",
    "write_scenario_file",
    *sorted(_LAZY),
]


def __getattr__(name):
    if name in _LAZY:
        from . import datasets

        return getattr(datasets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
