"""Pointing accuracy of a captioner's results split by mention: the 1st, 2nd, ... class word of a caption.

    python scripts/pointing_by_mention.py runs/captioner_fashion_scenes/results_test.json \
        data/fashion_scenes/annotations/instances_test.json

The results are the records of a results JSON (docs/formats/results.md), as ``vision-attn test`` or
``vision-attn caption`` writes them; the boxes come from the COCO instances file of the same split, in the pixels
of the network input (Fashion scenes are drawn at that size).
"""

from __future__ import annotations

import argparse
import json

from pycocotools.coco import COCO

from vision_attn.metrics import pointing_by_mention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="results JSON (docs/formats/results.md)")
    parser.add_argument("instances", help="COCO instances JSON of the same split")
    options = parser.parse_args()
    with open(options.results, encoding="utf-8") as file:
        records = json.load(file)
    coco = COCO(options.instances)
    names = {category["id"]: category["name"] for category in coco.cats.values()}
    boxes = {image_id: [(names[a["category_id"]], a["bbox"]) for a in coco.imgToAnns.get(image_id, [])]
             for image_id in coco.imgs}
    print("| objects in scene | mention | pointing | α mass in box | words |")
    print("| --- | --- | --- | --- | --- |")
    for (objects, mention), scores in pointing_by_mention(records, boxes).items():
        print(f"| {objects} | {mention} | {scores['pointing_accuracy']:.3f} | {scores['alpha_mass_in_box']:.3f} "
              f"| {int(scores['pointing_words'])} |")


if __name__ == "__main__":
    main()
