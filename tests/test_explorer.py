"""The attention explorer (`vision-attn explore`) in a real browser: Debian's chromium driven by Playwright,
from file:// and from an HTTP server on 127.0.0.1. Screenshots of each check are saved under the test's tmp
folder."""

from __future__ import annotations

import io
import json
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import run_in_process
from vision_attn.vit.rollout import attention_rollout, class_map

CHROMIUM = "/usr/bin/chromium"
HOSTILE = "a <script>window.__pwned = 1</script> \"red\" bag & 'a' <b>bold</b> </script><img src=x onerror=alert(1)>"


def alphas_peaked(cells: list[int], locations: int = 9) -> list[list[float]]:
    """One α row per word, each with most of its mass on the given cell of a 3x3 grid."""
    rows = []
    for cell in cells:
        row = [0.2 / (locations - 1)] * locations
        row[cell] = 0.8
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                              args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    context.close()
    assert not errors, errors


@pytest.fixture(scope="module")
def captioner_site(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A site from hand-made results records over small real PNGs: words peaked on known cells, a multihead
    record with beams, and a hostile caption; written through the CLI."""
    work = tmp_path_factory.mktemp("explore")
    records = []
    for k, (tokens, cells) in enumerate([(["a", "red", "bag", "left"], [0, 4, 8, 2]),
                                         (["two", "heads"], [6, 1]),
                                         (HOSTILE.split(" ")[:3], [3, 5, 7])]):
        array = np.zeros((96, 96, 3), np.uint8)
        array[10:40, 10:40] = (200, 40, 40)
        array[50:90, 50:90] = (40, 60, 200)
        Image.fromarray(array).save(work / f"scene_{k}.png")
        record = {"image_id": k + 1, "file_name": f"scene_{k}.png", "caption": " ".join(tokens), "tokens": tokens,
                  "grid": [3, 3], "image_size": [96, 96], "alphas": alphas_peaked(cells),
                  "betas": [0.5 + 0.1 * t for t in range(len(tokens))]}
        records.append(record)
    records[2]["caption"] = HOSTILE
    heads = [alphas_peaked([6, 1]), alphas_peaked([2, 3])]  # head 1, head 2
    records[1]["head_alphas"] = [[heads[0][t], heads[1][t]] for t in range(2)]
    records[1]["alphas"] = [list((np.array(heads[0][t]) + np.array(heads[1][t])) / 2) for t in range(2)]
    records[1]["beams"] = [{k: records[1][k] for k in ("caption", "tokens", "alphas", "betas", "head_alphas")}
                           | {"score": -0.5, "log_prob": -1.0},
                           {"caption": "one head", "tokens": ["one", "head"], "alphas": alphas_peaked([0, 8]),
                            "betas": [0.3, 0.4], "head_alphas": [alphas_peaked([0, 0]), alphas_peaked([8, 8])],
                            "score": -0.9, "log_prob": -1.8}]
    (work / "results.json").write_text(json.dumps(records))
    result = run_in_process("explore", str(work / "results.json"), "--out", str(work / "site"))
    assert result.returncode == 0, result.stderr
    assert "open " in result.stdout and "index.html" in result.stdout
    return work / "site", records


def canvas_pixels(page) -> np.ndarray:
    """The canvas as drawn on screen, RGB (H, W, 3)."""
    return np.asarray(Image.open(io.BytesIO(page.locator("#canvas").screenshot())).convert("RGB"), dtype=np.float32)


def cell_change(before: np.ndarray, after: np.ndarray, grid: int = 3) -> np.ndarray:
    """Mean absolute pixel change per cell of a grid x grid partition, (grid, grid)."""
    change = np.abs(after - before).mean(axis=2)
    h, w = change.shape
    return np.array([[change[r * h // grid:(r + 1) * h // grid, c * w // grid:(c + 1) * w // grid].mean()
                      for c in range(grid)] for r in range(grid)])


def open_view(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=10_000)


def test_hovering_a_word_draws_its_alpha_brightest_on_the_attended_cell(page, captioner_site, tmp_path) -> None:
    site, records = captioner_site
    open_view(page, (site / "view.html").as_uri() + "?n=0")
    assert page.evaluate("VA.state.map") is None  # the image alone until a word is chosen
    before = canvas_pixels(page)
    for t, cell in enumerate([0, 4, 8, 2]):
        page.hover(f"#words button[data-t='{t}']")
        page.screenshot(path=str(tmp_path / f"word_{t}.png"))
        after = canvas_pixels(page)
        change = cell_change(before, after)
        assert np.unravel_index(change.argmax(), change.shape) == divmod(cell, 3), (t, change.round(1))
        assert change.max() > 20  # the attended cell glows
        state = page.evaluate("({map: VA.state.map, heat: Array.from(VA.state.heat), w: canvas.width})")
        assert state["map"] == pytest.approx(records[0]["alphas"][t])
        peak = int(np.argmax(state["heat"]))
        assert (peak // state["w"] * 3 // 96, peak % state["w"] * 3 // 96) == divmod(cell, 3)
    assert "β = 0.8" in page.inner_text("#status")  # the last word's β, as text


def test_the_keyboard_steps_through_the_words_and_play_animates_them(page, captioner_site, tmp_path) -> None:
    site, _ = captioner_site
    open_view(page, (site / "view.html").as_uri() + "?n=0")
    page.focus("#words button[data-t='0']")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert page.evaluate("VA.state.word") == 2
    assert page.evaluate("document.activeElement.dataset.t") == "2"
    page.keyboard.press("ArrowLeft")
    assert page.evaluate("VA.state.word") == 1
    page.keyboard.press("End")
    assert page.evaluate("VA.state.word") == 3
    page.screenshot(path=str(tmp_path / "keyboard.png"))
    page.keyboard.press("Home")
    page.click("#play")
    seen = set()
    deadline = time.time() + 8
    while time.time() < deadline and len(seen) < 4:
        seen.add(page.evaluate("VA.state.word"))
        page.wait_for_timeout(100)
    assert seen == {0, 1, 2, 3}  # play walked the whole sentence
    page.wait_for_function("document.getElementById('play').textContent.endsWith('play')", timeout=3000)
    assert page.evaluate("VA.state.word") == 3  # and stopped at its end


def test_heads_and_beams_have_their_selectors(page, captioner_site, tmp_path) -> None:
    site, records = captioner_site
    open_view(page, (site / "view.html").as_uri() + "?n=1")
    page.hover("#words button[data-t='0']")
    assert page.evaluate("VA.state.map") == pytest.approx(records[1]["alphas"][0])  # the heads' mean
    page.select_option("#head", "1")
    assert page.evaluate("VA.state.map") == pytest.approx(records[1]["head_alphas"][0][1])
    page.screenshot(path=str(tmp_path / "head_2.png"))
    page.select_option("#beam", "1")
    assert page.inner_text("#caption") == "one head"
    page.hover("#words button[data-t='1']")
    assert page.evaluate("VA.state.map") == pytest.approx(records[1]["beams"][1]["head_alphas"][1][1])
    open_view(page, (site / "view.html").as_uri() + "?n=0")
    assert page.locator("#head").count() == 0 and page.locator("#beam").count() == 0


def test_a_hostile_caption_stays_text(page, captioner_site, tmp_path) -> None:
    site, _ = captioner_site
    page.on("dialog", lambda dialog: pytest.fail(f"a dialog opened: {dialog.message}"))
    page.goto((site / "index.html").as_uri())
    page.wait_for_selector("body[data-ready='1']")
    assert page.locator(".card .text").nth(2).inner_text() == HOSTILE
    open_view(page, (site / "view.html").as_uri() + "?n=2")
    assert page.inner_text("#caption") == HOSTILE
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#panel b, #panel img, #panel script, .card b").count() == 0
    page.screenshot(path=str(tmp_path / "hostile.png"))


def test_the_index_searches_caption_words_and_links_each_image(page, captioner_site) -> None:
    site, _ = captioner_site
    page.goto((site / "index.html").as_uri())
    page.wait_for_selector("body[data-ready='1']")
    assert page.inner_text("#count") == "3 of 3 images"
    page.fill("#search", "hea")
    assert page.inner_text("#count") == "1 of 3 images"
    page.click(".card:not([hidden])")
    page.wait_for_selector("body[data-ready='1']")
    assert page.inner_text("#caption") == "two heads"


def serve(folder: Path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(folder)))
    server.RequestHandlerClass.log_message = lambda *args: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_same_site_works_from_an_http_server(page, captioner_site, tmp_path) -> None:
    site, _ = captioner_site
    server = serve(site)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        page.goto(f"{url}/index.html")
        page.wait_for_selector("body[data-ready='1']")
        page.click(".card >> nth=0")
        page.wait_for_selector("body[data-ready='1']")
        page.hover("#words button[data-t='2']")
        assert page.evaluate("canvas.dataset.drawn") == "map"
        page.screenshot(path=str(tmp_path / "http.png"))
    finally:
        server.shutdown()


def item_data(site: Path, number: int) -> dict:
    text = (site / "data" / "items" / f"{number}.js").read_text()
    return json.loads(text.removeprefix("VA.item(").rstrip().removesuffix(");"))


def test_the_vit_page_computes_rollout_as_the_library_does(page, vit_checkpoint, tmp_path) -> None:
    images = tmp_path / "items"
    images.mkdir()
    generator = torch.Generator().manual_seed(0)
    for k in range(2):
        Image.fromarray(torch.randint(0, 255, (28, 28), generator=generator, dtype=torch.uint8).numpy()).save(
            images / f"item_{k}.png")
    result = run_in_process("explore", "--ckpt", str(vit_checkpoint), "--images", str(images),
                            "--out", str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr
    site = tmp_path / "site"
    item = item_data(site, 1)
    assert len(item["top"]) == 5 and item["grid"] == [4, 4]
    attentions = [torch.tensor(layer, dtype=torch.float64).view(1, len(layer), item["tokens"], item["tokens"])
                  for layer in item["attention"]]
    open_view(page, (site / "view.html").as_uri() + "?n=1")
    assert [row.split(" — ")[0] for row in page.locator("#top li").all_inner_texts()] == [n for n, _ in item["top"]]
    for fusion, ratio in (("mean", "0"), ("max", "0.5"), ("min", "0.25")):
        page.select_option("#fusion", fusion)
        page.locator("#discard").fill(ratio)
        expected = class_map(attention_rollout(attentions, head_fusion=fusion, discard_ratio=float(ratio)), (4, 4))
        assert page.evaluate("VA.state.map") == pytest.approx(expected.flatten().tolist(), abs=1e-9)
    page.screenshot(path=str(tmp_path / "vit_rollout.png"))
    page.select_option("#map", "1")  # head 2 of layer l
    page.locator("#layer").fill("1")
    expected = attentions[0][0, 1, 0, 1:]
    assert page.evaluate("VA.state.map") == pytest.approx(expected.tolist(), abs=1e-9)
    page.select_option("#map", "rollout")
    one_layer = class_map(attention_rollout(attentions[:1], discard_ratio=0.25, head_fusion="min"), (4, 4))
    assert page.evaluate("VA.state.map") == pytest.approx(one_layer.flatten().tolist(), abs=1e-9)


def test_an_index_of_1000_images_loads_in_under_two_seconds(page, tmp_path) -> None:
    work = tmp_path / "many"
    work.mkdir()
    records = []
    for k in range(1000):
        Image.new("RGB", (16, 16), (k % 256, 90, 200)).save(work / f"{k}.png")
        records.append({"image_id": k, "file_name": f"{k}.png", "caption": f"a caption number {k}",
                        "tokens": ["a", "caption", "number", str(k)], "grid": [3, 3], "image_size": [16, 16],
                        "alphas": alphas_peaked([k % 9, 0, 1, 2]), "betas": [0.5] * 4})
    (work / "results.json").write_text(json.dumps(records))
    result = run_in_process("explore", str(work / "results.json"), "--out", str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr
    start = time.perf_counter()
    page.goto((tmp_path / "site" / "index.html").as_uri())
    page.wait_for_selector("body[data-ready='1']")
    elapsed = time.perf_counter() - start
    page.screenshot(path=str(tmp_path / "index_1000.png"))
    assert page.locator(".card").count() == 1000
    assert elapsed < 2.0, f"the index of 1000 images took {elapsed:.2f} s"


def test_bad_input_is_a_one_line_error_and_leaves_nothing_half_written(captioner_site, tmp_path) -> None:
    site, records = captioner_site
    results = site.parent / "results.json"
    missing = run_in_process("explore", str(tmp_path / "nope.json"), "--out", str(tmp_path / "out"))
    assert missing.returncode != 0 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps([{**records[0], "alphas": [[1.0]]}]))
    result = run_in_process("explore", str(broken), "--images", str(site.parent), "--out", str(tmp_path / "out"))
    assert result.returncode != 0 and "alphas must hold one row per token" in result.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    refused = run_in_process("explore", str(results), "--out", str(tmp_path / "mine"))
    assert refused.returncode != 0 and "did not write" in refused.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    inside = run_in_process("explore", str(results), "--out", str(site.parent))
    assert inside.returncode != 0 and "holds the input" in inside.stderr
    again = run_in_process("explore", str(results), "--out", str(site))  # a site of ours is replaced
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in site.rglob(".vision-attn-staging-*")) == []
