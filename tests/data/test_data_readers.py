"""Readers for user data, on small fixtures written into tmp_path."""

from __future__ import annotations

import io
import logging
import pickle

import numpy as np
import pytest
from PIL import Image

from raycompat.data import (
    CorruptImageError,
    ImageRecord,
    load_image,
    read_gldv2_csv,
    read_image_folder,
    read_parquet_images,
    read_revisited,
)


def png_bytes(value: int, size=(12, 10), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, (value,) * len(mode) if len(mode) > 1 else value).save(buf, format="PNG")
    return buf.getvalue()


def write_jpg(path, value: int, size=(16, 12)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, value, value)).save(path, format="JPEG")


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "imgs"
    for c, name in enumerate(["zebra", "ant", "moth"]):
        d = root / name
        d.mkdir(parents=True)
        for k in range(c + 1):
            (d / f"im{k}.png").write_bytes(png_bytes(40 * c + k))
    (root / "ant" / "notes.txt").write_text("not an image")
    return root


def test_image_folder(folder):
    rs = read_image_folder(folder)
    assert rs.class_names == ["ant", "moth", "zebra"]
    assert len(rs) == 6 and rs.num_classes == 3
    assert rs.labels.tolist() == [0, 0, 1, 1, 1, 2]
    assert [r.item_id for r in rs] == list(range(6))
    assert all(r.split == "train" and r.path.endswith(".png") for r in rs)
    img = load_image(rs[0], mode="L", resolution=8)
    assert img.size == (8, 8) and img.mode == "L"


def test_image_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        read_image_folder(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=str(tmp_path)):
        read_image_folder(tmp_path)


def test_corrupt_image_raise_and_skip(folder, caplog):
    bad = folder / "moth" / "im9.png"
    bad.write_bytes(png_bytes(9)[:40])  # truncated PNG
    garbage = folder / "ant" / "junk.jpg"
    garbage.write_bytes(b"definitely not a jpeg")
    with pytest.raises(CorruptImageError, match="im9.png"):
        load_image(str(bad))
    with pytest.raises(CorruptImageError, match="junk.jpg"):
        load_image(garbage)
    with pytest.raises(CorruptImageError, match="junk.jpg"):  # first unreadable file in order
        read_image_folder(folder, verify=True)
    with caplog.at_level(logging.WARNING):
        assert load_image(str(bad), on_error="skip") is None
        assert "im9.png" in caplog.text
        caplog.clear()
        rs = read_image_folder(folder, verify=True, on_error="skip")
    assert len(rs) == 6
    assert sorted(rs.skipped) == sorted([str(bad), str(garbage)])
    assert "skipped 2 unreadable image(s)" in caplog.text and "im9.png" in caplog.text
    with pytest.raises(FileNotFoundError, match="missing.png"):
        load_image(folder / "missing.png")
    with pytest.raises(ValueError, match="on_error"):
        load_image(str(bad), on_error="ignore")


def test_bytes_error_names_source():
    with pytest.raises(CorruptImageError, match="item 42"):
        load_image(b"\x89PNG\r\n\x1a\n garbage", source="item 42")
    img = load_image(png_bytes(200, mode="L"), mode="RGB")
    assert img.mode == "RGB" and img.getpixel((0, 0)) == (200, 200, 200)


def test_gldv2_csv(tmp_path, caplog):
    root = tmp_path / "train"
    ids = {"abc0001": 7, "abd0002": 7, "f0f0003": 138, "0a90004": 3}
    for i in ids:
        write_jpg(root / i[0] / i[1] / i[2] / f"{i}.jpg", 100)
    csv_path = tmp_path / "train.csv"
    csv_path.write_text(
        "id,url,landmark_id\n" + "".join(f"{i},http://x/{i},{lm}\n" for i, lm in ids.items())
    )
    rs = read_gldv2_csv(csv_path, root)
    assert rs.class_names == ["3", "7", "138"]
    assert rs.labels.tolist() == [1, 1, 2, 0]
    assert rs[0].path == str(root / "a" / "b" / "c" / "abc0001.jpg")
    assert load_image(rs[2]).size == (16, 12)
    # train_clean.csv layout
    clean = tmp_path / "train_clean.csv"
    clean.write_text("landmark_id,images\n7,abc0001 abd0002\n138,f0f0003\n")
    assert read_gldv2_csv(clean, root).labels.tolist() == [0, 0, 1]
    # bad column
    bad = tmp_path / "bad.csv"
    bad.write_text("id,url,landmark\nabc0001,u,7\n")
    with pytest.raises(ValueError, match="landmark_id") as e:
        read_gldv2_csv(bad, root)
    assert "bad.csv" in str(e.value)
    # missing image file
    csv_path.write_text(csv_path.read_text() + "zzz0005,u,3\n")
    missing = str(root / "z" / "z" / "z" / "zzz0005.jpg")
    with pytest.raises(FileNotFoundError, match="zzz0005.jpg"):
        read_gldv2_csv(csv_path, root)
    with caplog.at_level(logging.WARNING):
        rs = read_gldv2_csv(csv_path, root, on_error="skip")
    assert len(rs) == 4 and rs.skipped == [missing] and "zzz0005.jpg" in caplog.text
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        read_gldv2_csv(tmp_path / "nope.csv", root)


@pytest.fixture
def revisited(tmp_path):
    root = tmp_path / "roxford5k"
    imlist = [f"g{k}" for k in range(6)]
    qimlist = ["q0", "q1"]
    for n in imlist + qimlist:
        write_jpg(root / "jpg" / f"{n}.jpg", 50, size=(40, 30))
    gnd = [
        dict(bbx=[2, 3, 20, 25], easy=[0, 1], hard=[2], junk=[5]),
        dict(bbx=[0, 0, 10, 10], easy=[], hard=[3, 4], junk=[0]),
    ]
    with open(root / "gnd_roxford5k.pkl", "wb") as fh:
        pickle.dump({"imlist": imlist, "qimlist": qimlist, "gnd": gnd}, fh)
    return root


def test_revisited(revisited):
    data = read_revisited(revisited, "roxford5k")
    assert [r.item_id for r in data.gallery] == list(range(6))
    assert [r.split for r in data.queries] == ["query", "query"]
    assert data.queries[0].bbox == (2.0, 3.0, 20.0, 25.0)
    assert data.gallery[3].path.endswith("jpg/g3.jpg")
    assert load_image(data.queries[0]).size == (18, 22)  # cropped to the box
    easy, medium, hard = (data.protocol(level) for level in ("easy", "medium", "hard"))
    assert easy[0]["ok"].tolist() == [0, 1] and easy[0]["junk"].tolist() == [2, 5]
    assert medium[0]["ok"].tolist() == [0, 1, 2] and medium[0]["junk"].tolist() == [5]
    assert hard[0]["ok"].tolist() == [2] and hard[0]["junk"].tolist() == [0, 1, 5]
    assert medium[1]["ok"].tolist() == [3, 4] and easy[1]["ok"].tolist() == []
    with pytest.raises(ValueError, match="extreme"):
        data.protocol("extreme")
    # the revisitop layout root/<dataset>/ works too
    assert len(read_revisited(revisited.parent, "roxford5k").gallery) == 6


def test_revisited_errors(revisited, caplog):
    with pytest.raises(FileNotFoundError, match="gnd_rparis6k.pkl"):
        read_revisited(revisited, "rparis6k")
    (revisited / "jpg" / "g4.jpg").write_bytes(b"\xff\xd8\xff garbage")
    (revisited / "jpg" / "g5.jpg").unlink()
    with pytest.raises(FileNotFoundError, match="g5.jpg"):
        read_revisited(revisited, "roxford5k")
    with caplog.at_level(logging.WARNING):
        data = read_revisited(revisited, "roxford5k", verify=True, on_error="skip")
    assert [r.item_id for r in data.gallery] == [0, 1, 2, 3]
    assert len(data.skipped) == 2 and "g4.jpg" in caplog.text and "g5.jpg" in caplog.text


def test_parquet_images(tmp_path, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = [png_bytes(10), png_bytes(20, mode="L"), b"garbage bytes", png_bytes(30)]
    path = tmp_path / "images.parquet"
    pq.write_table(
        pa.table(
            {
                "image": pa.array(images, pa.binary()),
                "label": [5, 2, 5, 9],
                "item_id": [100, 101, 102, 103],
            }
        ),
        path,
    )
    rs = read_parquet_images(path)
    assert rs.class_names == ["2", "5", "9"]
    assert rs.labels.tolist() == [1, 0, 1, 2]
    assert [r.item_id for r in rs] == [100, 101, 102, 103]
    assert np.asarray(load_image(rs[1], mode="L")).max() == 20
    with pytest.raises(CorruptImageError, match="item_id=102"):
        read_parquet_images(path, verify=True)
    with caplog.at_level(logging.WARNING):
        rs = read_parquet_images(path, verify=True, on_error="skip")
    assert [r.item_id for r in rs] == [100, 101, 103]
    assert len(rs.skipped) == 1 and "item_id=102" in rs.skipped[0] and "item_id=102" in caplog.text
    with pytest.raises(ValueError, match="'pixels'"):
        read_parquet_images(path, image_column="pixels")
    # Hugging Face style struct column, no id column
    hf = tmp_path / "hf.parquet"
    pq.write_table(
        pa.table({"image": [{"bytes": images[0], "path": "a.png"}], "label": ["cat"]}), hf
    )
    rs = read_parquet_images(hf, id_column=None)
    assert rs.class_names == ["cat"] and rs[0].item_id == 0 and load_image(rs[0]).size == (12, 10)


def test_image_record_dataset(folder, caplog):
    import torch

    from raycompat.data import ImageRecordDataset, collate_skip_none

    rs = read_image_folder(folder)
    ds = ImageRecordDataset(rs, resolution=8, in_chans=3)
    x, y = ds[0]
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and y == 0
    assert -1.0 <= float(x.min()) and float(x.max()) <= 1.0
    bad = ImageRecord(str(folder / "ant" / "bad.png"), 0, 99)
    (folder / "ant" / "bad.png").write_bytes(b"nope")
    with pytest.raises(CorruptImageError, match="bad.png"):
        ImageRecordDataset([bad], resolution=8)[0]
    ds = ImageRecordDataset([*rs.records, bad], resolution=8, in_chans=1, on_error="skip")
    with caplog.at_level(logging.WARNING):
        assert ds[len(ds) - 1] is None
        batch = collate_skip_none([ds[0], ds[len(ds) - 1]])
    assert ds.skipped == [bad.path] and batch[0].shape == (1, 1, 8, 8) and "bad.png" in caplog.text
    ds = ImageRecordDataset([*rs.records, bad], resolution=8, on_error="skip", verify=True)
    assert len(ds) == 6 and ds.skipped == [bad.path]
