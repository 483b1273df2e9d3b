"""The built-in glyph catalog (pixel-based exclusions) and the renderer."""

from __future__ import annotations

import json
import os
import pickle
import time

import numpy as np
import pytest

from raycompat.data import GlyphCatalog, GlyphRenderer, default_catalog
from raycompat.data import glyphs as G


@pytest.fixture(scope="module")
def catalog() -> GlyphCatalog:
    return default_catalog()


def _name(catalog, f):
    return os.path.basename(catalog.font_paths[f])


def test_catalog_shape(catalog):
    assert catalog.num_classes > 2000
    assert catalog.codepoints.dtype == np.int64
    assert np.all(np.diff(catalog.codepoints) > 0)
    assert len(catalog.font_paths) == len(set(catalog.font_paths))
    for i in range(catalog.num_classes):
        fonts = catalog.fonts_for_class(i)
        assert len(fonts) >= 8 and len(np.unique(fonts)) == len(fonts)
        assert fonts.min() >= 0 and fonts.max() < len(catalog.font_paths)
    assert catalog.exclusions["min_fonts"] == 8
    assert catalog.char(catalog.class_of(ord("A"))) == "A"


def test_placeholder_font_detected_from_pixels(catalog):
    ex = catalog.exclusions
    assert "LastResortHE-Regular.ttf" in ex["placeholder_fonts"]
    assert not any("LastResort" in p for p in catalog.font_paths)
    assert ex["placeholder_font_fraction"]["LastResortHE-Regular.ttf"] > G.PLACEHOLDER_FONT_FRACTION
    # The pixel evidence: LastResort draws the same box for consecutive code points it
    # "maps", while a real font draws distinct glyphs.
    last = str(G.font_dir() / "LastResortHE-Regular.ttf")
    dejavu = str(G.font_dir() / "DejaVuSans.ttf")
    boxes = {G._raw_key(G.render_ink(last, cp, G.DETECT_SIZE)) for cp in range(0x4E00, 0x4E10)}
    letters = {G._raw_key(G.render_ink(dejavu, cp, G.DETECT_SIZE)) for cp in range(0x41, 0x51)}
    assert len(boxes) == 1 and len(letters) == 16
    assert G._placeholder_fraction(last, list(range(0x4E00, 0x4F00))) == 1.0
    assert G._placeholder_fraction(dejavu, G.font_cmap(dejavu)) < 0.2


def test_notdef_rendering_is_not_a_class_glyph(catalog):
    # Whatever a font draws for a code point it lacks (.notdef) never appears as a kept glyph.
    for f in range(len(catalog.font_paths)):
        path = catalog.font_paths[f]
        notdef = G._raw_key(G.render_ink(path, G.NOTDEF_PROBE, G.DETECT_SIZE))
        classes = [i for i in range(0, catalog.num_classes, 7) if f in catalog.fonts_for_class(i)]
        for i in classes[:40]:
            assert (
                G._raw_key(G.render_ink(path, int(catalog.codepoints[i]), G.DETECT_SIZE)) != notdef
            )


def test_no_blank_class(catalog):
    assert catalog.exclusions["blank_classes"], (
        "space-like code points should have been found blank"
    )
    assert ord(" ") in catalog.exclusions["blank_classes"]
    for i in range(catalog.num_classes):
        f = int(catalog.fonts_for_class(i)[i % len(catalog.fonts_for_class(i))])
        img = G.normalized_glyph(catalog.font_paths[f], int(catalog.codepoints[i]), G.DETECT_SIZE)
        assert img is not None and img.max() > 0, hex(catalog.codepoints[i])


@pytest.mark.parametrize(
    "font", ["DejaVuSans.ttf", "DejaVuSerif-Italic.ttf", "STIXGeneral.ttf", "cmr10.ttf"]
)
def test_no_two_classes_identical_in_a_shared_font(catalog, font):
    f = [os.path.basename(p) for p in catalog.font_paths].index(font)
    classes = [i for i in range(catalog.num_classes) if f in catalog.fonts_for_class(i)]
    imgs = np.stack(
        [
            G.normalized_glyph(catalog.font_paths[f], int(catalog.codepoints[i]), G.DETECT_SIZE)
            for i in classes
        ]
    )
    assert len({im.tobytes() for im in imgs}) == len(classes)
    assert G._near_identical_pairs(imgs) == []


def test_lookalike_duplicates_keep_lowest_code_point(catalog):
    dups = {int(k): v for k, v in catalog.exclusions["duplicate_classes"].items()}
    for lookalike in (0x391, 0x410):  # Greek Alpha, Cyrillic A
        assert dups.get(lookalike) == ord("A")
        with pytest.raises(KeyError):
            catalog.class_of(lookalike)
    dejavu = str(G.font_dir() / "DejaVuSans.ttf")
    a, alpha = (G.normalized_glyph(dejavu, cp, G.DETECT_SIZE) for cp in (0x41, 0x391))
    assert np.array_equal(a, alpha)
    for dropped, kept in dups.items():
        assert kept < dropped and kept not in dups


def test_mismapped_fonts_excluded(catalog):
    # cmex10 / cmsy10 map ASCII code points to TeX symbols: pixels disagree with other fonts.
    ex = catalog.exclusions
    assert {"cmex10.ttf", "cmsy10.ttf"} <= set(ex["mismapped_fonts"])
    assert ex["font_agreement_top5"]["cmex10.ttf"] < G.MISMAPPED_FONT_AGREEMENT
    assert ex["font_agreement_top5"]["DejaVuSans.ttf"] > 0.5
    assert not any(os.path.basename(p) in ("cmex10.ttf", "cmsy10.ttf") for p in catalog.font_paths)


def test_catalog_dict_roundtrip_and_cache(catalog, tmp_path):
    again = GlyphCatalog.from_dict(json.loads(json.dumps(catalog.to_dict())))
    assert np.array_equal(again.codepoints, catalog.codepoints)
    assert again.font_paths == catalog.font_paths
    assert all(
        np.array_equal(again.fonts_for_class(i), catalog.fonts_for_class(i)) for i in (0, 5, 100)
    )
    # build() reads the JSON cache keyed by fonts, min_fonts and version.
    d = catalog.to_dict()
    d["exclusions"] = dict(d["exclusions"], marker="from-cache")
    key = G._cache_key(G.font_files(), 8)
    (tmp_path / f"glyph_catalog_{key}.json").write_text(json.dumps(d))
    t = time.perf_counter()
    cached = GlyphCatalog.build(cache_dir=tmp_path)
    assert time.perf_counter() - t < 1.0
    assert cached.exclusions["marker"] == "from-cache"
    assert G._cache_key(G.font_files(), 9) != key


def test_render_deterministic(catalog):
    r1 = GlyphRenderer(catalog, resolution=32, seed=3)
    r2 = GlyphRenderer(catalog, resolution=32, seed=3)
    c = catalog.class_of(ord("g"))
    a = r1.render(c, 5)
    assert a.dtype == np.uint8 and a.shape == (32, 32)
    assert np.array_equal(a, r2.render(c, 5))
    r2.render_batch([c + 1, c + 2], [0, 1])  # cache state must not matter
    assert np.array_equal(a, r2.render(c, 5))
    assert not np.array_equal(a, r1.render(c, 6))
    assert not np.array_equal(a, GlyphRenderer(catalog, 32, seed=4).render(c, 5))
    assert not np.array_equal(a, r1.render(c, 5, view=1))
    assert r1.font_for(c, 5) == r2.font_for(c, 5)


def test_render_batch_and_resolutions(catalog):
    cls = np.array([0, 10, 20, 30])
    ins = np.array([0, 1, 2, 3])
    for res in (32, 64, 17):
        r = GlyphRenderer(catalog, resolution=res, seed=0)
        batch = r.render_batch(cls, ins)
        assert batch.shape == (4, res, res) and batch.dtype == np.uint8
        assert all(np.array_equal(batch[k], r.render(cls[k], ins[k])) for k in range(4))
        assert batch.reshape(4, -1).max(1).min() > 100  # a bright glyph in every image
    clean = GlyphRenderer(catalog, resolution=32, seed=0, augment=False)
    x = clean.render(0, 0)
    assert np.array_equal(x, clean.render(0, 0)) and x.max() > 200 and x[0].max() == 0
    with pytest.raises(IndexError):
        clean.render(catalog.num_classes, 0)
    with pytest.raises(ValueError):
        clean.render_batch([0, 1], [0])


def test_renderer_pickles(catalog):
    r = GlyphRenderer(catalog, resolution=32, seed=1)
    a = r.render(7, 7)
    r2 = pickle.loads(pickle.dumps(r))
    assert np.array_equal(a, r2.render(7, 7))


def test_render_speed(catalog):
    r = GlyphRenderer(catalog, resolution=32, seed=0)
    cls = np.arange(400) % 50
    r.render_batch(cls, np.arange(400))  # warm the glyph cache
    t = time.perf_counter()
    r.render_batch(cls, np.arange(400, 800))
    rate = 400 / (time.perf_counter() - t)
    assert rate > 200, f"{rate:.0f} images/s"  # loose: shared 2-core CI machine
