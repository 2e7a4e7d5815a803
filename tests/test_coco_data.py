"""Captioning data on small COCO-format and Karpathy-format sets written here, and the vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vision_attn.data.caption_datasets import CaptionBatch, EvalCaptionBatch
from vision_attn.data.scenes import CLASS_WORDS
from vision_attn.data.vocabulary import END_ID, PAD_ID, START_ID, UNK_ID, Vocabulary, tokenize
from vision_attn.datamodules import CocoCaptionsDataModule
from vision_attn.errors import DatasetNotFoundError

SIZE = 32
CAPTIONS = {
    "train": {
        1: ("grey.png", ["A dog runs on the grass.", "The DOG, running!"]),
        2: ("rgba.png", ["A cat sits", "a cat on a mat"]),
        3: ("cmyk.jpg", ["Cyan square", "a cyan square", "A CYAN block."]),
    },
    "val": {
        11: ("palette.png", ["A zebra grazes.", "zebra in a field", "a dog and a zebra"]),
        12: ("sixteen.png", ["a cat"]),
        13: ("uncaptioned.png", []),
    },
    "test": {21: ("wide.jpg", ["a square", "a cat"])},
}


def _write_images(folder: Path) -> None:
    """Odd sizes and modes: grey, RGBA half transparent, CMYK JPEG, palette, 16-bit grey, wide RGB JPEG."""
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.tile(np.arange(50, dtype=np.uint8) * 5, (30, 1)), mode="L").save(folder / "grey.png")
    rgba = np.zeros((60, 40, 4), dtype=np.uint8)
    rgba[..., 0] = 255
    rgba[30:, :, 3] = 255  # bottom half opaque red, top half fully transparent
    Image.fromarray(rgba, mode="RGBA").save(folder / "rgba.png")
    Image.new("CMYK", (64, 48), (255, 0, 0, 0)).save(folder / "cmyk.jpg", quality=95)  # pure cyan
    Image.new("RGB", (33, 17), (0, 0, 255)).convert("P").save(folder / "palette.png")
    Image.fromarray(np.full((20, 20), 40000, dtype=np.uint16)).save(folder / "sixteen.png")
    Image.new("RGB", (90, 20), (0, 200, 0)).save(folder / "wide.jpg")
    Image.new("RGB", (8, 8)).save(folder / "uncaptioned.png")


def _write_coco(root: Path, captions: dict = CAPTIONS) -> Path:
    for split, images in captions.items():
        _write_images(root / "images" / split)
        annotations = [{"id": 100 * image_id + k, "image_id": image_id, "caption": caption}
                       for image_id, (_, texts) in images.items() for k, caption in enumerate(texts)]
        entries = [{"id": image_id, "file_name": name}
                   for image_id, (name, _) in images.items()]
        (root / "annotations").mkdir(parents=True, exist_ok=True)
        (root / "annotations" / f"captions_{split}.json").write_text(
            json.dumps({"images": entries, "annotations": annotations}))
    return root


@pytest.fixture
def coco_root(tmp_path: Path) -> Path:
    return _write_coco(tmp_path / "coco")


def _karpathy(root: Path, split_of: dict[str, str]) -> Path:
    """A dataset_coco.json whose images live in train2014/ and val2014/ under ``root``."""
    _write_images(root / "train2014")
    _write_images(root / "val2014")
    entries = [{"filepath": "train2014" if split in ("train", "restval") else "val2014", "filename": name,
                "cocoid": 1000 + index, "split": split,
                "sentences": [{"tokens": ["a", name.split(".")[0], "photo"], "raw": f"A {name.split('.')[0]} photo."},
                              {"tokens": ["another", "Photo"], "raw": "Another photo"}]}
               for index, (name, split) in enumerate(split_of.items())]
    (root / "dataset_coco.json").write_text(json.dumps({"images": entries, "dataset": "coco"}))
    return root


def test_tokenize_drops_case_and_punctuation() -> None:
    assert tokenize("A Man's T-Shirt, Red!") == ["a", "man's", "t-shirt", "red"]
    assert tokenize("  'Quoted' -- text ... (in brackets); yes?") == ["quoted", "text", "in", "brackets", "yes"]
    assert tokenize("there is a red sneaker, a white bag and a blue coat") == [
        "there", "is", "a", "red", "sneaker", "a", "white", "bag", "and", "a", "blue", "coat"]


def test_vocabulary_build_encode_decode_and_json(tmp_path: Path) -> None:
    vocab = Vocabulary.build(["b a c", "a b", "a d", "D!"], min_count=2)
    assert vocab.tokens == ["<pad>", "<start>", "<end>", "<unk>", "a", "b", "d"]  # by count, then a-z
    assert (PAD_ID, START_ID, END_ID, UNK_ID) == (0, 1, 2, 3) and len(vocab) == 7 and "c" not in vocab
    assert vocab.encode(["a", "c", "d"]) == [START_ID, 4, UNK_ID, 6, END_ID]
    assert vocab.encode(["a", "b", "d", "a"], 2) == [START_ID, 4, 5, END_ID]  # at most 2 words
    assert vocab.decode([START_ID, 4, UNK_ID, 5, END_ID, 6, PAD_ID]) == ["a", "b"]
    assert vocab.decode(torch.tensor([4, 6])) == ["a", "d"]
    with pytest.raises(ValueError, match="outside this vocabulary"):
        vocab.decode([99])
    vocab.to_json(tmp_path / "vocab.json")
    assert json.loads((tmp_path / "vocab.json").read_text()) == {"tokens": vocab.tokens, "min_count": 2}
    loaded = Vocabulary.from_json(tmp_path / "vocab.json")
    assert loaded.tokens == vocab.tokens and loaded.min_count == 2
    (tmp_path / "bad.json").write_text('{"tokens": ["a", "b"]}')
    with pytest.raises(ValueError, match=r"bad.json: a vocabulary's tokens must start with"):
        Vocabulary.from_json(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json: not a readable JSON file"):
        Vocabulary.from_json(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="must be unique"):
        Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a", "a"])


def test_encode_batch_matches_encoding_one_by_one() -> None:
    captions = ["A dog, running!", "", "...", "two\nlines here", "Ünïcode café au lait", "a b c d e f g h",
                "t-shirt -- man's", "zebra"]
    vocab = Vocabulary.build(captions[:-1])
    assert vocab.tokens == Vocabulary.build([tokenize(c) for c in captions[:-1]]).tokens
    ids, lengths = vocab.encode_batch(captions, max_length=5)
    expected = [vocab.encode(tokenize(caption), 5) for caption in captions]
    assert lengths.tolist() == [len(e) for e in expected] and ids.shape == (len(captions), 7)
    assert [row[:n] for row, n in zip(ids.tolist(), lengths.tolist(), strict=True)] == expected
    assert all(token == PAD_ID for row, n in zip(ids.tolist(), lengths.tolist(), strict=True) for token in row[n:])
    assert vocab.encode_batch([], 5)[0].shape == (0, 2)


def test_coco_splits_items_and_train_only_vocabulary(coco_root: Path) -> None:
    dm = CocoCaptionsDataModule(str(coco_root), image_size=SIZE, loader={"batch_size": 4})
    assert dm.vocab_size == len(dm.vocab) > 4  # known before setup, for LightningCLI's link into the model
    assert dm.vocab_tokens == dm.vocab.tokens and dm.vocab_tokens[:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    assert "zebra" not in dm.vocab and "dog" in dm.vocab and "square" in dm.vocab  # zebra is only in val
    assert "running" in dm.vocab and "DOG" not in dm.vocab  # lower-cased, punctuation stripped
    dm.setup("fit")
    dm.setup("test")
    assert len(dm.train_set) == 7  # one item per caption
    assert len(dm.val_set) == 2 and len(dm.test_set) == 1  # one per captioned image, never one per caption
    references = {image_id: refs for batch in dm.val_dataloader() for image_id, refs in
                  zip(batch.image_ids, batch.references, strict=True)}
    assert references == {11: CAPTIONS["val"][11][1], 12: ["a cat"]}
    zebra_caption = tokenize(CAPTIONS["val"][11][1][0])
    assert dm.vocab.encode(zebra_caption)[2] == UNK_ID


def test_min_word_count(coco_root: Path) -> None:
    dm = CocoCaptionsDataModule(str(coco_root), image_size=SIZE, vocabulary={"min_word_count": 2})
    assert {"a", "cat", "cyan", "dog", "square"} <= set(dm.vocab.tokens)
    assert not {"grass", "mat", "block", "sits"} & set(dm.vocab.tokens)


def test_train_batches_are_padded_with_lengths(coco_root: Path) -> None:
    dm = CocoCaptionsDataModule(str(coco_root), image_size=SIZE, vocabulary={"max_caption_length": 4},
                                loader={"batch_size": 7})
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert isinstance(batch, CaptionBatch)
    assert batch.images.shape == (7, 3, SIZE, SIZE) and batch.images.dtype == torch.uint8
    assert batch.captions.dtype == torch.int64 and batch.lengths.dtype == torch.int64
    assert batch.captions.shape == (7, int(batch.lengths.max())) == (7, 6)  # 4 words + <start>, <end>
    every = {" ".join(tokenize(c)[:4]) for _, texts in CAPTIONS["train"].values() for c in texts}
    decoded = set()
    for caption, length in zip(batch.captions.tolist(), batch.lengths.tolist(), strict=True):
        assert caption[0] == START_ID and caption[length - 1] == END_ID
        assert all(token == PAD_ID for token in caption[length:])
        decoded.add(" ".join(dm.vocab.decode(caption)))
    assert decoded == every  # every caption once per epoch, cut to 4 words


def test_grouped_batches_hold_every_caption_of_each_image_once(coco_root: Path) -> None:
    dm = CocoCaptionsDataModule(str(coco_root), image_size=SIZE, group_captions=True, loader={"batch_size": 2})
    dm.setup("fit")
    assert len(dm.train_set) == len(CAPTIONS["train"])  # one item per image
    seen = []
    for batch in dm.train_dataloader():
        assert batch.caption_images is not None and len(batch.caption_images) == len(batch.captions)
        for image_index, caption in zip(batch.caption_images.tolist(), batch.captions.tolist(), strict=True):
            assert 0 <= image_index < len(batch.images)
            seen.append(" ".join(dm.vocab.decode(caption)))
        for image_index in range(len(batch.images)):  # each image's captions are one file entry's captions
            own = {" ".join(dm.vocab.decode(c)) for c, i in zip(batch.captions.tolist(),
                                                                batch.caption_images.tolist(), strict=True)
                   if i == image_index}
            assert any(own == {" ".join(tokenize(t)) for t in texts} for _, texts in CAPTIONS["train"].values())
    every = sorted(" ".join(tokenize(c)) for _, texts in CAPTIONS["train"].values() for c in texts)
    assert sorted(seen) == every  # every caption exactly once per epoch


def test_images_become_rgb_squares_whatever_their_mode(coco_root: Path) -> None:
    dm = CocoCaptionsDataModule(str(coco_root), image_size=SIZE, loader={"batch_size": 8, "eval_batch_size": 8})
    dm.setup("fit")
    dm.setup("test")
    by_path = {dm.train_set.paths[int(i)].name: dm.train_set[n][0] for n, i in enumerate(dm.train_set.image_index)}
    val = next(iter(dm.val_dataloader()))
    by_path["palette.png"], by_path["sixteen.png"] = val.images[0], val.images[1]
    by_path["wide.jpg"] = next(iter(dm.test_dataloader())).images[0]
    for image in by_path.values():
        assert image.shape == (3, SIZE, SIZE) and image.dtype == torch.uint8
    grey = by_path["grey.png"].int()
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2]) and grey[0, :, -1].min() > 200
    rgba = by_path["rgba.png"].int()
    assert rgba[:, :12].max() == 0  # transparent top half on black
    assert (rgba[0, 20:] > 240).all() and rgba[1:, 20:].max() < 15  # opaque red bottom half
    cyan = by_path["cmyk.jpg"].int().flatten(1).float().mean(1)
    assert cyan[0] < 15 and cyan[1] > 240 and cyan[2] > 240
    assert by_path["palette.png"][2].min() > 240 and by_path["palette.png"][:2].max() < 15
    assert torch.all(by_path["sixteen.png"] == 40000 // 256)
    assert by_path["wide.jpg"][1].float().mean() > 190  # squashed to the square, not cropped or padded


def test_batches_normalised_after_transfer(coco_root: Path) -> None:
    dm = CocoCaptionsDataModule(str(coco_root), image_size=SIZE, mean=[0.5, 0.4, 0.3], std=[0.2, 0.2, 0.2],
                                loader={"batch_size": 2})
    dm.setup("fit")
    train = next(iter(dm.train_dataloader()))
    val = next(iter(dm.val_dataloader()))
    for batch in (train, val):
        moved = dm.transfer_batch_to_device(batch, torch.device("cpu"), 0)
        normalised = dm.on_after_batch_transfer(moved, 0)
        assert type(normalised) is type(batch)
        expected = (batch.images.float() / 255 - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / 0.2
        assert torch.allclose(normalised.images, expected)
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(normalised[1:], batch[1:], strict=True))
    assert isinstance(val, EvalCaptionBatch) and val.image_ids == [11, 12]


def test_vocab_file_round_trip(coco_root: Path, tmp_path: Path) -> None:
    dm = CocoCaptionsDataModule(str(coco_root), image_size=SIZE)
    dm.save_vocab(tmp_path / "vocab.json")
    (coco_root / "annotations" / "captions_train.json").unlink()  # a vocab file needs no training captions
    reloaded = CocoCaptionsDataModule(str(coco_root), image_size=SIZE,
                                      vocabulary={"vocab_file": str(tmp_path / "vocab.json")})
    assert reloaded.vocab.tokens == dm.vocab.tokens and reloaded.vocab_size == dm.vocab_size
    reloaded.setup("validate")
    assert len(reloaded.val_set) == 2


@pytest.mark.parametrize("file_name", ["../../../etc/passwd", "/etc/passwd", "sub/../../outside.png"])
def test_paths_leaving_the_image_folder_are_refused(tmp_path: Path, file_name: str) -> None:
    captions = {**CAPTIONS, "train": {1: (file_name, ["a dog"])}}
    root = _write_coco(tmp_path / "coco", captions)
    with pytest.raises(ValueError, match=r"captions_train.json: image path .* points outside the image folder"):
        CocoCaptionsDataModule(str(root))


def test_missing_and_malformed_annotation_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match=r"captions_train.json: captions file not found"):
        CocoCaptionsDataModule(str(tmp_path / "nowhere"))
    root = _write_coco(tmp_path / "coco")
    with pytest.raises(DatasetNotFoundError, match=r"pictures: image folder not found \(the images of .*train"):
        CocoCaptionsDataModule(str(root), layout={"image_dir_pattern": "pictures"})
    (root / "annotations" / "captions_train.json").write_text('{"images": [], "annotations": [{"id": 1}]}')
    with pytest.raises(ValueError, match="captions_train.json: not a COCO captions file"):
        CocoCaptionsDataModule(str(root))
    (root / "annotations" / "captions_train.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="captions_train.json: not a readable JSON file"):
        CocoCaptionsDataModule(str(root))
    with pytest.raises(ValueError, match="may only contain the placeholder"):
        CocoCaptionsDataModule(str(root), layout={"captions_file_pattern": "annotations/{part}.json"})


def test_karpathy_splits_with_restval_in_train(tmp_path: Path) -> None:
    root = _karpathy(tmp_path / "k", {"grey.png": "train", "rgba.png": "restval", "cmyk.jpg": "val",
                                      "wide.jpg": "test", "palette.png": "test"})
    dm = CocoCaptionsDataModule(str(root), image_size=SIZE, layout={"annotation_format": "karpathy"},
                                loader={"batch_size": 8})
    assert {"grey", "rgba", "photo", "another"} <= set(dm.vocab.tokens)  # train and restval captions
    assert "cmyk" not in dm.vocab and "wide" not in dm.vocab  # val and test words stay out
    dm.setup("fit")
    dm.setup("test")
    assert len(dm.train_set) == 4 and len(dm.val_set) == 1 and len(dm.test_set) == 2
    val = next(iter(dm.val_dataloader()))
    assert val.image_ids == [1002] and val.references == [["A cmyk photo.", "Another photo"]]
    assert {path.parent.name for path in dm.train_set.paths} == {"train2014"}
    assert next(iter(dm.test_dataloader())).images.shape == (2, 3, SIZE, SIZE)


def test_karpathy_bad_input_is_refused(tmp_path: Path) -> None:
    root = _karpathy(tmp_path / "k", {"grey.png": "train", "rgba.png": "dev"})
    with pytest.raises(ValueError, match=r"dataset_coco.json: images\[1\]: unknown split 'dev'"):
        CocoCaptionsDataModule(str(root), layout={"annotation_format": "karpathy"})
    with pytest.raises(ValueError, match="val_split 'restval' is not a Karpathy split"):
        CocoCaptionsDataModule(str(root), layout={"annotation_format": "karpathy", "val_split": "restval"})
    data = json.loads((root / "dataset_coco.json").read_text())
    data["images"] = [{**data["images"][0], "filepath": "../.."}]
    (root / "dataset_coco.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="points outside the image folder"):
        CocoCaptionsDataModule(str(root), layout={"annotation_format": "karpathy"})


def test_generate_scenes_creates_and_then_reuses_a_scenes_root(tmp_path: Path) -> None:
    root = tmp_path / "fashion_scenes"
    counts = {"train": 6, "val": 2, "test": 2}
    dm = CocoCaptionsDataModule(str(root), loader={"batch_size": 30}, scenes={"generate": True, "counts": counts})
    captions_file = root / "annotations" / "captions_train.json"
    assert captions_file.is_file() and len(list((root / "images" / "train").glob("*.png"))) == 6
    assert set(dm.vocab.tokens) >= {"a", "to", "of"} and set(dm.vocab.tokens) & set(CLASS_WORDS)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.images.shape == (30, 3, 96, 96)
    raw = {tuple(tokenize(a["caption"])) for a in json.loads(captions_file.read_text())["annotations"]}
    assert {tuple(dm.vocab.decode(caption)) for caption in batch.captions} == raw  # default length cuts none
    val = {record.image_id: record.objects for record in dm.records("val")}  # instances_val.json + attributes
    assert set(val) == {1, 2} and all(word in CLASS_WORDS and len(box) == 4 for word, box, _ in val[1])
    assert all(colour in ("red", "green", "blue", "yellow", "white") for _, _, colour in val[1])
    assert all(record.objects is None for record in dm.records("train"))
    stamp = captions_file.stat().st_mtime_ns
    CocoCaptionsDataModule(str(root), scenes={"generate": True, "counts": counts})
    assert captions_file.stat().st_mtime_ns == stamp  # already there: not generated again


def test_generated_scenes_take_their_style_per_split_and_a_root_of_another_style_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "varied"
    counts, styles = {"train": 6, "val": 2, "test": 2}, {"train": {"layout": "free", "shade_jitter": 1.0}}
    CocoCaptionsDataModule(str(root), scenes={"generate": True, "counts": counts, "styles": styles})
    infos = {split: json.loads((root / "annotations" / f"captions_{split}.json").read_text())["info"]
             for split in counts}
    assert infos["train"]["style"] == {"layout": "free", "shade_jitter": 1.0, "scale_jitter": 0.0, "hue_jitter": 0.0,
                                             "palette": "exact"}
    assert "style" not in infos["val"] and "style" not in infos["test"]  # the default scenes for evaluation
    CocoCaptionsDataModule(str(root), scenes={"generate": True, "counts": counts, "styles": styles})  # reused
    other = CocoCaptionsDataModule(str(root), scenes={"generate": True, "counts": counts})  # asks the default style
    other.setup("test")  # reads only the test split, which is as asked
    with pytest.raises(ValueError) as refused:
        other.setup("fit")
    assert str(refused.value) == (f"{root / 'annotations' / 'captions_train.json'}: the train scenes were drawn with "
                                  "layout free, shade_jitter 1.0, but data.init_args.scenes.styles asks for layout "
                                  "grid, shade_jitter 0.0; ask for the style they were drawn in, or point "
                                  "data.init_args.root at scenes drawn as asked")
    with pytest.raises(ValueError, match="scenes.styles names split"):
        CocoCaptionsDataModule(str(root), scenes={"generate": True, "styles": {"dev": {}}})
