"""The inference tools: classify, caption, overlay, evaluate, explore."""

from __future__ import annotations

from collections.abc import Sequence

from vision_attn.cli_arguments import bounded_int, parser_for
from vision_attn.commands import tool


@tool("classify", "top-k classes of images with a trained ViT; JSON of each image's classes")
def classify_command(argv: Sequence[str]) -> None:
    """``vision-attn classify``: print each image's top-k classes and write them as JSON (``write_classifications``)."""
    parser = parser_for("classify", "Top-k classes of images with a ViT: prints each image's classes, best first, "
                        'and writes them as JSON, a list of {"file_name", "label", "probability", "top_k": '
                        '[{"class", "probability"}, ...]} in input order (probabilities from 0 to 1, 6 decimals).',
                        "device", "bad_images", "batch_size")
    parser.add_argument("--ckpt", required=True, help="ViT checkpoint (.ckpt) written by `vision-attn fit`")
    parser.add_argument("inputs", nargs="+", help="image files or folders of images")
    parser.add_argument("--top-k", type=bounded_int(1, 1000, "no checkpoint here has more than ImageNet's 1000 "
                                                    "classes"), default=5,
                        help="classes to list per image, 1 to 1000 (default 5)")
    parser.add_argument("--out", default="classes.json", help="JSON to write (default classes.json)")
    options = parser.parse_args(argv)
    from vision_attn.api import iter_classifications, load_classifier, write_classifications
    from vision_attn.data.images import expand_inputs
    from vision_attn.errors import Interrupted
    from vision_attn.io import output_file
    paths = [path for _, path in expand_inputs(options.inputs)]  # a bad input or output: one line, before any work
    out = output_file(options.out, inputs=[options.ckpt, *paths])
    classifier, results = load_classifier(options.ckpt, device=options.device), []
    try:
        for result in iter_classifications(classifier, paths, top_k=options.top_k, batch_size=options.batch_size,
                                           on_bad_image=options.on_bad_image):
            results.append(result)  # kept before it is shown: an interrupt never loses a printed result
            print(result.source)
            for name, probability in result.top_k:
                print(f"  {probability:7.2%}  {name}")
    except KeyboardInterrupt:  # keep every image classified so far, as a valid JSON
        path = write_classifications(out, results)
        raise Interrupted(f"interrupted: wrote the classes of the {len(results)} of {len(paths)} images finished "
                          f"so far to {path}") from None
    path, skipped = write_classifications(out, results), len(paths) - len(results)
    print(f"wrote the classes of {len(results)} images to {path}"
          + (f" ({skipped} unreadable images skipped)" if skipped else ""))


@tool("caption", "caption images with a trained captioner; results JSON with attention")
def caption_command(argv: Sequence[str]) -> None:
    """``vision-attn caption``: caption image files, folders or a COCO split; write the results JSON with attention."""
    parser = parser_for("caption", "Caption images with a Show-Attend-Tell checkpoint; writes results JSON with "
                        "attention (docs/formats/results.md).", "device", "bad_images", "beam", "batch_size")
    parser.add_argument("--ckpt", required=True, help="captioner checkpoint (.ckpt) written by `vision-attn fit`")
    parser.add_argument("inputs", nargs="*", help="image files or folders of images")
    parser.add_argument("--coco-annotations", help="a COCO captions JSON: caption its images instead")
    parser.add_argument("--image-dir", help="the images of --coco-annotations")
    parser.add_argument("--out", default="results.json", help="results JSON to write (default results.json)")
    parser.add_argument("--all-beams", action="store_true",
                        help="also list every beam of each search (caption, tokens, α, β, score) under `beams`")
    options = parser.parse_args(argv)
    if bool(options.coco_annotations) != bool(options.image_dir):
        parser.error("--coco-annotations and --image-dir go together")
    if not options.inputs and not options.coco_annotations:
        parser.error("give image files or folders, or --coco-annotations with --image-dir")
    from vision_attn.captioning.evaluation import caption_inputs, write_captions
    from vision_attn.io import output_file
    output_file(options.out, inputs=[options.coco_annotations] if options.coco_annotations else [])
    inputs = caption_inputs(options.inputs, coco_annotations=options.coco_annotations, image_dir=options.image_dir)
    written = write_captions(options.ckpt, inputs, options.out, beam_size=options.beam, batch_size=options.batch_size,
                             on_bad_image=options.on_bad_image, device=options.device,
                             on_record=lambda record: print(f"{record['file_name']}: {record['caption']}"),
                             all_beams=options.all_beams)
    print(f"wrote {written.count} captions with attention to {written.path}{written.skipped_note}")


@tool("overlay", "attention over images: per word (captioner) or rollout and heads (ViT)")
def overlay_command(argv: Sequence[str]) -> None:
    """``vision-attn overlay``: draw the attention over images (or a results JSON) into PNGs and an index.html."""
    parser = parser_for("overlay", "Attention over images, one PNG each and an index.html: per word for a captioner "
                        "(or `caption`'s JSON), rollout and last-layer heads for a ViT.", "device", "bad_images",
                        "head_fusion", "discard_ratio", "beam", "batch_size", "overwrite")
    parser.add_argument("inputs", nargs="+", help="image files, folders of images, or results JSON from `caption`")
    parser.add_argument("--ckpt", help="captioner or ViT checkpoint (not needed when every input is a results JSON)")
    parser.add_argument("--out", required=True, help="output folder for the PNGs and index.html")
    from vision_attn.gallery import OverlayOptions, draw_overlays
    OverlayOptions.add_arguments(parser)
    options = parser.parse_args(argv)
    style = OverlayOptions.from_arguments(options)
    written = draw_overlays(options.inputs, options.out, checkpoint=options.ckpt, options=style, beam_size=options.beam,
                            batch_size=options.batch_size, on_bad_image=options.on_bad_image, device=options.device,
                            on_overlay=lambda source, text, path: print(f"{source}: {text} -> {path}"),
                            overwrite=options.overwrite)
    print(f"wrote {written.count} overlays and {written.page}{written.skipped_note}")


@tool("evaluate", "score any COCO results JSON: caption metrics; pointing and scene metrics with instances")
def evaluate_command(argv: Sequence[str]) -> None:
    """``vision-attn evaluate``: score a COCO results file; scene metrics and pointing with the instances."""
    parser = parser_for("evaluate", "Score a COCO results file (ours or another tool's) against COCO captions.")
    parser.add_argument("results", help="results JSON: [{image_id, caption}], or what `caption` writes; a string "
                        "image_id that is no image id of --annotations (caption's file name of an image, 1.png) is "
                        "matched to the image of that file_name")
    parser.add_argument("--annotations", required=True, help="COCO captions JSON holding the references")
    parser.add_argument("--instances", help="COCO instances JSON: scene metrics, and pointing for `caption`'s JSON")
    parser.add_argument("--attributes", help="the scenes' attributes JSON (the objects' colours)")
    parser.add_argument("--words", help="with --instances, which caption words name which category: coco (the 80 "
                        "categories' words), scenes, or a JSON table (docs/formats/object-words.md); adds CHAIR "
                        "and, with masks in the instances, the α mass in the mask")
    parser.add_argument("--out", default="scores.json", help="scores JSON to write (default scores.json)")
    options = parser.parse_args(argv)
    if options.words and not options.instances:
        parser.error("--words goes with --instances")
    from vision_attn.captioning.evaluation import evaluate_results, scores_table
    scores = evaluate_results(options.results, options.annotations, instances=options.instances,
                              attributes=options.attributes, words=options.words, out=options.out)
    print(f"{scores_table(scores)}\nwrote {options.out}")


@tool("explore", "an interactive attention explorer: a static site to open in a browser")
def explore_command(argv: Sequence[str]) -> None:
    """``vision-attn explore``: write the interactive attention explorer, a static site."""
    parser = parser_for("explore", "Write the attention explorer, a static site (no network needed; open its "
                        "index.html from disk or serve the folder): each word's α over its image (captioner), or "
                        "rollout, layers and heads (ViT), drawn in the browser.", "device", "bad_images", "beam",
                        "overwrite")
    parser.add_argument("results", nargs="?",
                        help="results JSON written by `vision-attn caption` (docs/formats/results.md)")
    parser.add_argument("--images", nargs="*", default=[],
                        help="with a results JSON: the folder its images are in (default: as `overlay` finds "
                             "them); with --ckpt: image files or folders to run the model on")
    parser.add_argument("--ckpt", help="run this checkpoint (captioner or ViT) on --images first")
    parser.add_argument("--instances", help="COCO instances JSON: the scene metrics of each image on the index")
    parser.add_argument("--attributes", help="the scenes' attributes JSON (the objects' colours)")
    parser.add_argument("--out", default="site", help="folder to write the site into (default site/)")
    options = parser.parse_args(argv)
    if options.results and len(options.images) > 1:
        parser.error("with a results JSON, --images is the one folder its images are in")
    if options.attributes and not options.instances:
        parser.error("--attributes goes with --instances")
    from vision_attn.explorer import explore
    site, count = explore(results=options.results, images=options.images, out=options.out,
                          checkpoint=options.ckpt, instances=options.instances, attributes=options.attributes,
                          beam_size=options.beam, device=options.device, on_bad_image=options.on_bad_image,
                          overwrite=options.overwrite)
    print(f"wrote the attention explorer for {count} images: open {(site / 'index.html').resolve()} "
          f"(or serve it: python -m http.server -d {site})")
