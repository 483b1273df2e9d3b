"""Built-in glyph data set: a class is a Unicode code point, an instance is that
code point drawn in one of matplotlib's bundled TrueType fonts under random
augmentation.

`GlyphCatalog.build` decides which (font, code point) pairs are usable by comparing
rendered pixels (placeholder fonts, .notdef glyphs, blank and duplicate classes);
`GlyphRenderer` draws deterministic augmented instances at any resolution.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

logger = logging.getLogger(__name__)

#: Bump when the detection rules change, to invalidate cached catalogs.
CATALOG_VERSION = 6
#: Canvas side (pixels) at which exclusions are decided.
DETECT_SIZE = 24
#: Fraction of the canvas that the longest side of a normalised glyph fills.
GLYPH_FILL = 0.75
#: A code point no font in the set maps; rendering it yields the font's .notdef.
NOTDEF_PROBE = 0x10FFFD
#: A font is a placeholder font when more than this fraction of sampled code
#: points renders identically to .notdef or to another sampled code point.
PLACEHOLDER_FONT_FRACTION = 0.5
#: Two normalised renderings (uint8) are "the same glyph" when their mean absolute
#: difference is at most this and their maximum absolute difference at most
#: NEAR_MAX_DIFF.
NEAR_MEAN_DIFF = 1.0
NEAR_MAX_DIFF = 48
#: Two code points are duplicate classes when their renderings are near-identical
#: in at least this fraction of the fonts that draw both; below it, only the
#: higher code point's glyphs in the fonts where they coincide are dropped.
DUPLICATE_FONT_FRACTION = 0.5
#: A font is mis-mapped (its cmap points code points at other shapes, like the
#: TeX-encoded cmex10/cmsy10) when fewer than this fraction of its glyphs have their
#: own class among the 5 nearest class prototypes of the fonts outside its cmap
#: cohort (fonts with near-identical cmaps).
MISMAPPED_FONT_AGREEMENT = 0.2
#: ... judged only for fonts with at least this many candidate glyphs.
MISMAPPED_MIN_GLYPHS = 20
#: A glyph is inconsistent (drawn for the wrong code point) when more than this
#: fraction of the classes has a prototype nearer to it than its own class's
#: prototype; prototypes come from fonts outside the glyph's cmap cohort.
INCONSISTENT_RANK_FRACTION = 0.05


def font_dir() -> Path:
    """Directory of the TrueType fonts that matplotlib ships."""
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


def font_files() -> list[str]:
    """Sorted paths of matplotlib's bundled ``.ttf`` files."""
    return sorted(str(p) for p in font_dir().glob("*.ttf"))


@functools.lru_cache(maxsize=2048)
def load_font(path: str, size: int) -> ImageFont.FreeTypeFont:
    """A cached PIL font object (basic layout: one code point, no shaping)."""
    return ImageFont.truetype(path, int(size), layout_engine=ImageFont.Layout.BASIC)


def font_cmap(path: str) -> list[int]:
    """Sorted code points that the font's cmap claims (candidates, not proof)."""
    from fontTools.ttLib import TTFont

    with TTFont(path, lazy=True) as tt:
        return sorted(tt.getBestCmap() or {})


def render_ink(path: str, codepoint: int, size: int):
    """Render one code point at font size ``size``, anchored at the left baseline.

    Returns ``(ink, (x0, y0))``: the tight uint8 ink crop and its offset from the
    anchor, or ``None`` when nothing is drawn.
    """
    font = load_font(path, size)
    ch = chr(codepoint)
    left, top, right, bottom = font.getbbox(ch, anchor="ls")
    pad = 2 + size // 8
    w, h = right - left + 2 * pad, bottom - top + 2 * pad
    if w <= 2 * pad or h <= 2 * pad:
        return None
    canvas = Image.new("L", (w, h), 0)
    ImageDraw.Draw(canvas).text((pad - left, pad - top), ch, font=font, fill=255, anchor="ls")
    box = canvas.getbbox()
    if box is None:
        return None
    ink = np.asarray(canvas.crop(box))
    return ink, (box[0] - pad + left, box[1] - pad + top)


_SIZE_LADDER_STEP = 2**0.25


def _ladder(size: float) -> int:
    """Round a font size up to a coarse geometric ladder (bounds font objects)."""
    k = int(np.ceil(np.log(max(size, 1.0)) / np.log(_SIZE_LADDER_STEP) - 1e-9))
    return int(round(_SIZE_LADDER_STEP**k))


def normalized_glyph(path: str, codepoint: int, canvas: int, fill: float = GLYPH_FILL, first=None):
    """The glyph scaled (aspect kept) so its longest side spans ``fill*canvas`` and
    centred on a ``canvas x canvas`` uint8 image; ``None`` if the glyph is blank.

    Size and position in the em box are deliberately normalised away: glyphs
    that differ only in those (``.`` vs ``·``) count as the same shape.
    ``first`` may pass an existing ``render_ink(path, codepoint, canvas)`` result.
    """
    if first is None:
        first = render_ink(path, codepoint, canvas)
    if first is None:
        return None
    target = max(1, int(round(fill * canvas)))
    longest = max(first[0].shape)
    size = _ladder(min(canvas * target / longest, 32 * canvas))
    ink = first[0] if size == canvas else (render_ink(path, codepoint, size) or first)[0]
    h, w = ink.shape
    scale = target / max(h, w)
    nw, nh = max(1, int(round(w * scale))), max(1, int(round(h * scale)))
    glyph = Image.fromarray(ink)
    if (nw, nh) != (w, h):
        glyph = glyph.resize(
            (nw, nh), Image.Resampling.LANCZOS if scale < 1 else Image.Resampling.BILINEAR
        )
    out = Image.new("L", (canvas, canvas), 0)
    out.paste(glyph, ((canvas - nw) // 2, (canvas - nh) // 2))
    return np.asarray(out)


def _raw_key(rendered) -> bytes:
    """Hashable exact identity of a raw rendering (pixels and placement)."""
    if rendered is None:
        return b"blank"
    ink, (x0, y0) = rendered
    return hashlib.blake2b(
        ink.tobytes() + np.array([x0, y0, *ink.shape], np.int64).tobytes(), digest_size=16
    ).digest()


def _placeholder_fraction(path: str, cmap: list[int], runs: int = 8, run_len: int = 8) -> float:
    """Fraction of sampled code points whose rendering equals .notdef or another
    sampled code point's rendering. Samples runs of consecutive cmap entries, so a
    font that draws one box per Unicode block (LastResort) scores near 1."""
    if len(cmap) < 2:
        return 0.0
    notdef = _raw_key(render_ink(path, NOTDEF_PROBE, DETECT_SIZE))
    starts = np.linspace(0, max(0, len(cmap) - run_len), runs).astype(int)
    sample = sorted({cmap[s + j] for s in starts for j in range(run_len) if s + j < len(cmap)})
    keys = [_raw_key(render_ink(path, cp, DETECT_SIZE)) for cp in sample]
    counts: dict[bytes, int] = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    bad = sum(1 for k in keys if k == notdef or counts[k] > 1)
    return bad / len(keys)


def _near_identical_pairs(images: np.ndarray) -> list[tuple[int, int]]:
    """Index pairs (i < j) of near-identical uint8 images (N, H, W)."""
    n = len(images)
    if n < 2:
        return []
    x = images.reshape(n, -1).astype(np.float32)
    sq = (x * x).sum(1)
    d2 = sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)
    # mean |diff| <= m implies mean diff^2 <= m * max|diff|; a cheap prefilter.
    limit = NEAR_MEAN_DIFF * NEAR_MAX_DIFF * x.shape[1] + 1.0
    ii, jj = np.nonzero(np.triu(d2 <= limit, k=1))
    pairs = []
    for i, j in zip(ii.tolist(), jj.tolist(), strict=False):
        diff = np.abs(x[i] - x[j])
        if diff.max() <= NEAR_MAX_DIFF and diff.mean() <= NEAR_MEAN_DIFF:
            pairs.append((i, j))
    return pairs


def _cmap_cohorts(cmaps: list[list[int]], min_jaccard: float = 0.9) -> list[int]:
    """Group fonts whose cmaps cover (nearly) the same code points: styles of one
    family, or a family that shares one custom encoding. Returns a group id per font."""
    sets = [set(c) for c in cmaps]
    parent = list(range(len(sets)))

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a in range(len(sets)):
        for b in range(a + 1, len(sets)):
            union = len(sets[a] | sets[b])
            if union and len(sets[a] & sets[b]) / union >= min_jaccard:
                parent[root(a)] = root(b)
    return [root(a) for a in range(len(sets))]


def _class_sums(images: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Per-class sums of image rows (a fast ``np.add.at``)."""
    total = np.zeros((num_classes, images.shape[1]), np.float32)
    if len(labels):
        order = np.argsort(labels, kind="stable")
        lab = labels[order]
        starts = np.flatnonzero(np.r_[True, lab[1:] != lab[:-1]])
        total[lab[starts]] = np.add.reduceat(images[order], starts, axis=0)
    return total


def _prototype_ranks(
    images: np.ndarray, labels: np.ndarray, groups: np.ndarray, num_classes: int
) -> np.ndarray:
    """For each image, how many other classes' prototypes are nearer to it than its
    own class's prototype, where prototypes are mean images over the fonts OUTSIDE
    the image's group (so a family cannot vouch for itself); -1 where no font
    outside the group draws the class. images (N, D) float32, labels/groups (N,)."""
    ranks = np.full(len(images), -1, np.int64)
    for g in np.unique(groups):
        mine = np.nonzero(groups == g)[0]
        other = groups != g
        count = np.bincount(labels[other], minlength=num_classes).astype(np.float32)
        total = _class_sums(images[other], labels[other], num_classes)
        protos = total / np.maximum(count, 1)[:, None]
        psq = np.where(count > 0, (protos * protos).sum(1), np.inf)
        for s in range(0, len(mine), 2048):
            idx = mine[s : s + 2048]
            x, lab = images[idx], labels[idx]
            d = (
                (x * x).sum(1)[:, None]
                + psq[None, :]
                - 2.0 * np.where(count > 0, x @ protos.T, 0.0)
            )
            own = d[np.arange(len(idx)), lab].copy()
            d[np.arange(len(idx)), lab] = np.inf
            ranks[idx] = np.where(count[lab] > 0, (d < own[:, None]).sum(1), -1)
    return ranks


def _cache_key(paths: list[str], min_fonts: int) -> str:
    """Hash of font files (names, sizes), rasteriser versions, settings and version."""
    from PIL import __version__ as pil_version
    from PIL import features

    h = hashlib.sha256()
    for p in paths:
        h.update(f"{os.path.basename(p)}:{os.path.getsize(p)};".encode())
    h.update(f"pil={pil_version};freetype={features.version('freetype2')};".encode())
    h.update(
        f"min_fonts={min_fonts};v={CATALOG_VERSION};size={DETECT_SIZE};fill={GLYPH_FILL}".encode()
    )
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("RAYCOMPAT_CACHE", Path.home() / ".cache" / "raycompat"))


class GlyphCatalog:
    """Usable glyph classes: ``codepoints[i]`` is class ``i``; ``fonts_for_class(i)``
    lists the indices into ``font_paths`` whose rendering of it passed every check."""

    def __init__(self, codepoints, font_paths, class_fonts, exclusions=None, build_seconds=None):
        self.codepoints = np.asarray(codepoints, dtype=np.int64)
        self.font_paths = [str(p) for p in font_paths]
        self._class_fonts = [np.asarray(f, dtype=np.int64) for f in class_fonts]
        self.exclusions = dict(exclusions or {})
        self.build_seconds = build_seconds
        if len(self._class_fonts) != len(self.codepoints):
            raise ValueError("class_fonts must have one entry per code point")
        if np.any(np.diff(self.codepoints) <= 0):
            raise ValueError("codepoints must be strictly increasing")

    @property
    def num_classes(self) -> int:
        return len(self.codepoints)

    def fonts_for_class(self, i: int) -> np.ndarray:
        return self._class_fonts[i]

    @property
    def fingerprint(self) -> str:
        """Short hash of the class list and fonts: equal fingerprints mean equal
        label spaces (check it where labels cross machines)."""
        h = hashlib.sha256(self.codepoints.tobytes())
        for p in self.font_paths:
            h.update(os.path.basename(p).encode() + b";")
        for fs in self._class_fonts:
            h.update(fs.tobytes())
        return h.hexdigest()[:16]

    def class_name(self, i: int) -> str:
        """The class name of glyph class ``i``: its code point, ``U+0041``."""
        return f"U+{int(self.codepoints[i]):04X}"

    def char(self, i: int) -> str:
        return chr(int(self.codepoints[i]))

    def class_of(self, codepoint: int) -> int:
        """Class index of a code point (``KeyError`` if not in the catalog)."""
        i = int(np.searchsorted(self.codepoints, codepoint))
        if i >= len(self.codepoints) or self.codepoints[i] != codepoint:
            raise KeyError(f"U+{codepoint:04X} is not a catalog class")
        return i

    def __repr__(self) -> str:
        return f"GlyphCatalog(num_classes={self.num_classes}, fonts={len(self.font_paths)})"

    # -- serialisation ---------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": CATALOG_VERSION,
            "font_files": [os.path.basename(p) for p in self.font_paths],
            "codepoints": self.codepoints.tolist(),
            "class_fonts": [f.tolist() for f in self._class_fonts],
            "exclusions": self.exclusions,
            "build_seconds": self.build_seconds,
        }

    @classmethod
    def from_dict(cls, d: dict, fonts: str | Path | None = None) -> GlyphCatalog:
        base = Path(fonts) if fonts is not None else font_dir()
        return cls(
            d["codepoints"],
            [str(base / f) for f in d["font_files"]],
            d["class_fonts"],
            d.get("exclusions"),
            d.get("build_seconds"),
        )

    # -- construction ------------------------------------------------------------
    @classmethod
    def build(
        cls, min_fonts: int = 8, cache_dir: str | Path | None = None, use_cache: bool = True
    ) -> GlyphCatalog:
        """Build (or load from the JSON cache) the catalog of classes drawn by at
        least ``min_fonts`` distinct fonts after all pixel-based exclusions."""
        paths = font_files()
        if not paths:
            raise FileNotFoundError(f"no .ttf fonts found in {font_dir()}")
        cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        cache_file = cache_dir / f"glyph_catalog_{_cache_key(paths, min_fonts)}.json"
        if use_cache and cache_file.exists():
            try:
                return cls.from_dict(json.loads(cache_file.read_text()))
            except (ValueError, KeyError) as exc:
                logger.warning("ignoring unreadable glyph catalog cache %s: %s", cache_file, exc)
        t0 = time.perf_counter()
        catalog = cls._detect(paths, min_fonts)
        catalog.build_seconds = round(time.perf_counter() - t0, 2)
        if use_cache:
            try:
                cache_dir.mkdir(parents=True, exist_ok=True)
                tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(catalog.to_dict()))
                os.replace(tmp, cache_file)
            except OSError as exc:
                logger.warning("could not write glyph catalog cache %s: %s", cache_file, exc)
        return catalog

    @classmethod
    def _detect(cls, paths: list[str], min_fonts: int) -> GlyphCatalog:
        names = [os.path.basename(p) for p in paths]
        cmaps = [font_cmap(p) for p in paths]

        # (a) placeholder fonts: most sampled code points draw the same box.
        frac = {
            names[f]: round(_placeholder_fraction(paths[f], cmaps[f]), 3) for f in range(len(paths))
        }
        placeholder_fonts = sorted(n for n, v in frac.items() if v > PLACEHOLDER_FONT_FRACTION)
        fonts = [f for f in range(len(paths)) if names[f] not in placeholder_fonts]

        # Candidate classes: claimed by enough remaining cmaps.
        claims: dict[int, list[int]] = {}
        for f in fonts:
            for cp in cmaps[f]:
                claims.setdefault(cp, []).append(f)
        candidates = sorted(cp for cp, fs in claims.items() if len(fs) >= min_fonts)

        # (b) placeholder glyphs and blank glyphs, from pixels.
        notdef = {f: _raw_key(render_ink(paths[f], NOTDEF_PROBE, DETECT_SIZE)) for f in fonts}
        glyphs: dict[int, dict[int, np.ndarray]] = {f: {} for f in fonts}  # font -> cp -> image
        placeholder_glyphs = blank_glyphs = 0
        for cp in candidates:
            for f in claims[cp]:
                raw = render_ink(paths[f], cp, DETECT_SIZE)
                if raw is None:
                    blank_glyphs += 1
                elif _raw_key(raw) == notdef[f]:
                    placeholder_glyphs += 1
                else:
                    img = normalized_glyph(paths[f], cp, DETECT_SIZE, first=raw)
                    if img is None:
                        blank_glyphs += 1
                    else:
                        glyphs[f][cp] = img

        def fonts_of(cp: int) -> list[int]:
            return [f for f in claims[cp] if cp in glyphs[f]]

        # (c) blank classes: nothing visible in any font.
        blank_classes = [cp for cp in candidates if not fonts_of(cp)]

        # (d) duplicates: near-identical renderings of two code points in one font.
        same: dict[tuple[int, int], list[int]] = {}  # (lo, hi) -> fonts where identical
        for f in fonts:
            cps = sorted(glyphs[f])
            if len(cps) < 2:
                continue
            imgs = np.stack([glyphs[f][cp] for cp in cps])
            for i, j in _near_identical_pairs(imgs):
                same.setdefault((cps[i], cps[j]), []).append(f)
        duplicate_classes: dict[int, int] = {}
        ambiguous_glyphs = 0
        dup_of: dict[int, list[tuple[int, list[int]]]] = {}
        for (lo, hi), fs in same.items():
            dup_of.setdefault(hi, []).append((lo, fs))
        for hi in sorted(dup_of):
            for lo, fs in sorted(dup_of[hi]):
                if hi in duplicate_classes:
                    break
                shared = set(fonts_of(lo)) & set(fonts_of(hi))
                if shared and len(shared & set(fs)) >= DUPLICATE_FONT_FRACTION * len(shared):
                    duplicate_classes[hi] = duplicate_classes.get(lo, lo)
                    continue
                if lo in duplicate_classes:
                    continue  # `lo` is dropped anyway; its partial twin may stay
                # Identical in a minority of shared fonts: drop those glyphs of `hi`.
                for f in fs:
                    if hi in glyphs[f] and lo in glyphs[f]:
                        del glyphs[f][hi]
                        ambiguous_glyphs += 1

        # (e) mis-mapped fonts and (f) inconsistent glyphs: a glyph should look like
        # the same code point in the other fonts (compared with class prototypes).
        mismapped_fonts, agreement, inconsistent_glyphs = [], {}, 0
        alive = [cp for cp in candidates if cp not in duplicate_classes and cp not in blank_classes]
        cohort = np.array(
            _cmap_cohorts([cmaps[f] if f in fonts else [] for f in range(len(paths))])
        )
        for stage in ("fonts", "glyphs"):
            index = {cp: i for i, cp in enumerate(alive)}
            entries = [
                (f, cp)
                for f in fonts
                if names[f] not in mismapped_fonts
                for cp in sorted(glyphs[f])
                if cp in index
            ]
            imgs = np.stack([glyphs[f][cp].ravel() for f, cp in entries]).astype(np.float32) / 255.0
            labels = np.array([index[cp] for _, cp in entries], np.int64)
            font_of = np.array([f for f, _ in entries])
            ranks = _prototype_ranks(imgs, labels, cohort[font_of], len(alive))
            if stage == "fonts":
                for f in fonts:
                    r = ranks[(font_of == f) & (ranks >= 0)]
                    if len(r):
                        agreement[names[f]] = round(float(np.mean(r < 5)), 3)
                    if len(r) >= MISMAPPED_MIN_GLYPHS and np.mean(r < 5) < MISMAPPED_FONT_AGREEMENT:
                        mismapped_fonts.append(names[f])
                for f in fonts:
                    if names[f] in mismapped_fonts:
                        glyphs[f].clear()
            else:
                limit = max(5, INCONSISTENT_RANK_FRACTION * len(alive))
                for (f, cp), r in zip(entries, ranks.tolist(), strict=False):
                    if r > limit:
                        del glyphs[f][cp]
                        inconsistent_glyphs += 1

        kept, kept_fonts, too_few = [], [], 0
        for cp in candidates:
            if cp in duplicate_classes or cp in blank_classes:
                continue
            fs = sorted(fonts_of(cp))
            if len(fs) >= min_fonts:
                kept.append(cp)
                kept_fonts.append(fs)
            else:
                too_few += 1

        used = sorted({f for fs in kept_fonts for f in fs})
        remap = {f: i for i, f in enumerate(used)}
        unused = sorted(names[f] for f in fonts if f not in remap)
        exclusions = {
            "fonts_total": len(paths),
            "fonts_kept": len(used),
            "placeholder_fonts": placeholder_fonts,
            "placeholder_font_fraction": frac,
            "fonts_without_kept_classes": unused,
            "candidate_classes": len(candidates),
            "mismapped_fonts": mismapped_fonts,
            "font_agreement_top5": agreement,
            "placeholder_glyphs": placeholder_glyphs,
            "inconsistent_glyphs": inconsistent_glyphs,
            "blank_glyphs": blank_glyphs,
            "ambiguous_glyphs": ambiguous_glyphs,
            "blank_classes": blank_classes,
            "duplicate_classes": {str(k): v for k, v in sorted(duplicate_classes.items())},
            "too_few_fonts_classes": too_few,
            "min_fonts": min_fonts,
            "detect_size": DETECT_SIZE,
        }
        return cls(
            kept,
            [paths[f] for f in used],
            [[remap[f] for f in fs] for fs in kept_fonts],
            exclusions,
        )


@functools.lru_cache(maxsize=4)
def default_catalog(min_fonts: int = 8) -> GlyphCatalog:
    """The catalog built (or loaded from cache) with default settings."""
    return GlyphCatalog.build(min_fonts=min_fonts)


class _LRU:
    """Tiny LRU dictionary (not shared between processes; rebuilt after pickling)."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.data: OrderedDict = OrderedDict()

    def get(self, key):
        value = self.data.get(key)
        if value is not None:
            self.data.move_to_end(key)
        return value

    def put(self, key, value):
        self.data[key] = value
        if len(self.data) > self.maxsize:
            self.data.popitem(last=False)


def _morph(a: np.ndarray, op, steps: int) -> np.ndarray:
    """3x3 grey dilation (``np.maximum``) or erosion (``np.minimum``), ``steps`` times."""
    for _ in range(steps):
        b = a.copy()
        op(b[1:], a[:-1], out=b[1:])
        op(b[:-1], a[1:], out=b[:-1])
        a = b.copy()
        op(a[:, 1:], b[:, :-1], out=a[:, 1:])
        op(a[:, :-1], b[:, 1:], out=a[:, :-1])
    return a


class GlyphRenderer:
    """Deterministic augmented glyph images.

    ``render(c, i)`` depends only on (seed, class index c, instance i) and the
    resolution: the font is drawn from ``catalog.fonts_for_class(c)`` and all
    augmentation parameters from ``np.random.default_rng([seed, c, i])``. The same
    (seed, c, i) at two resolutions is the same picture at two sizes (up to noise).
    Images are uint8, single channel, bright glyph on a dark background.
    """

    def __init__(
        self,
        catalog: GlyphCatalog,
        resolution: int = 32,
        seed: int = 0,
        augment: bool = True,
        cache_bytes: int = 64 << 20,
    ):
        if int(resolution) < 4:
            raise ValueError(f"resolution must be >= 4, got {resolution}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.catalog = catalog
        self.resolution = int(resolution)
        self.seed = int(seed)
        self.augment = bool(augment)
        self.cache_bytes = int(cache_bytes)
        self._init_cache()

    def _init_cache(self):
        big = 2 * self.resolution
        self._base = _LRU(max(64, self.cache_bytes // (big * big)))

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_base", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_cache()

    def font_for(self, class_index: int, instance: int) -> int:
        """Index into ``catalog.font_paths`` of the font used for an instance."""
        fonts = self.catalog.fonts_for_class(class_index)
        rng = np.random.default_rng([self.seed, int(class_index), int(instance)])
        return int(fonts[rng.integers(len(fonts))])

    def _base_glyph(self, font: int, codepoint: int) -> np.ndarray:
        """Clean normalised glyph at twice the output resolution (cached)."""
        key = (font, codepoint)
        arr = self._base.get(key)
        if arr is None:
            big = 2 * self.resolution
            arr = normalized_glyph(self.catalog.font_paths[font], codepoint, big)
            if arr is None:
                arr = np.zeros((big, big), np.uint8)
            arr.setflags(write=False)
            self._base.put(key, arr)
        return arr

    def render(self, class_index: int, instance: int, view: int = 0) -> np.ndarray:
        """One (H, W) uint8 image of class ``class_index``, instance ``instance``.

        ``view`` > 0 gives another independent augmentation of the same instance
        (same font), keyed ``[seed, class, instance, view]``; view 0 is the default.
        """
        c, inst, view = int(class_index), int(instance), int(view)
        if not 0 <= c < self.catalog.num_classes:
            raise IndexError(f"class index {c} out of range [0, {self.catalog.num_classes})")
        if inst < 0 or view < 0:
            raise ValueError(f"instance and view must be >= 0, got instance={inst}, view={view}")
        rng = np.random.default_rng([self.seed, c, inst])
        fonts = self.catalog.fonts_for_class(c)
        font = int(fonts[rng.integers(len(fonts))])
        if view:
            rng = np.random.default_rng([self.seed, c, inst, view])
        base = self._base_glyph(font, int(self.catalog.codepoints[c]))
        if not self.augment:
            return np.array(Image.fromarray(base).reduce(2))
        r = self.resolution
        big = 2 * r
        u = rng.random(16).tolist()

        # Stroke width: thin, keep, or thicken (morphology at 2x resolution).
        if u[0] < 0.12:
            base = ((base.astype(np.uint16) + _morph(base, np.minimum, 1)) >> 1).astype(np.uint8)
        elif u[0] > 0.6:
            base = _morph(base, np.maximum, 1 if u[0] < 0.88 else 2)

        # Random affine about the centre: rotation, anisotropic scale, shear, shift.
        angle = math.radians((u[1] - 0.5) * 24.0)
        scale = 0.8 + 0.3 * u[2]
        aspect = math.exp((u[3] - 0.5) * 0.2)
        shear = (u[4] - 0.5) * 0.3
        tx, ty = (u[5] - 0.5) * 0.16 * big, (u[6] - 0.5) * 0.16 * big
        cos, sin = math.cos(angle), math.sin(angle)
        sx, sy = scale * aspect, scale / aspect
        # forward = R @ Shear @ diag(sx, sy); PIL wants the inverse mapping.
        a, b_, c_, d = cos * sx, (cos * shear - sin) * sy, sin * sx, (sin * shear + cos) * sy
        det = a * d - b_ * c_
        ia, ib, ic, id_ = d / det, -b_ / det, -c_ / det, a / det
        cx = cy = big / 2.0
        ox = cx - (ia * (cx + tx) + ib * (cy + ty))
        oy = cy - (ic * (cx + tx) + id_ * (cy + ty))
        img = (
            Image.fromarray(base)
            .transform(
                (big, big),
                Image.Transform.AFFINE,
                (ia, ib, ox, ic, id_, oy),
                resample=Image.Resampling.BILINEAR,
            )
            .reduce(2)
        )

        # Contrast: glyph and background intensities.
        fg = 170.0 + 85.0 * u[7]
        bg = 40.0 * u[8] ** 2
        arr = np.asarray(img, dtype=np.float32) * ((fg - bg) / 255.0) + bg

        # Light clutter: a faint line or a few dots.
        if u[9] < 0.4:
            level = 60.0 + 80.0 * u[10]
            if u[11] < 0.5:
                x0, y0, x1, y1 = (rng.random(4) * (r - 1)).tolist()
                t = np.linspace(0.0, 1.0, 2 * r)
                xs = np.rint(x0 + (x1 - x0) * t).astype(np.intp)
                ys = np.rint(y0 + (y1 - y0) * t).astype(np.intp)
            else:
                pts = np.rint(rng.random((1 + int(3 * u[12]), 2)) * (r - 1)).astype(np.intp)
                xs, ys = pts[:, 0], pts[:, 1]
            arr[ys, xs] = np.maximum(arr[ys, xs], level)

        # Blur.
        if u[13] < 0.5:
            radius = (0.3 + 0.6 * u[14]) * r / 32.0
            arr = np.asarray(
                Image.fromarray((arr + 0.5).astype(np.uint8)).filter(
                    ImageFilter.GaussianBlur(radius)
                ),
                dtype=np.float32,
            )

        # Sensor noise.
        sigma = 10.0 * u[15]
        if sigma > 0.5:
            arr = arr + rng.standard_normal(arr.shape, dtype=np.float32) * sigma
        return np.clip(arr + 0.5, 0, 255).astype(np.uint8)

    def render_batch(self, class_indices, instances, view: int = 0) -> np.ndarray:
        """(N, H, W) uint8 images for paired class indices and instance numbers."""
        cls_ = np.asarray(class_indices, dtype=np.int64).ravel()
        ins = np.asarray(instances, dtype=np.int64).ravel()
        if cls_.shape != ins.shape:
            raise ValueError(
                f"class_indices ({cls_.size}) and instances ({ins.size}) differ in length"
            )
        out = np.empty((cls_.size, self.resolution, self.resolution), np.uint8)
        for k in range(cls_.size):
            out[k] = self.render(cls_[k], ins[k], view)
        return out
