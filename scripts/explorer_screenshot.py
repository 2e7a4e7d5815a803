"""A screenshot of an explorer page in the browser the tests drive (Debian's chromium, headless, through
Playwright), with one word hovered: how docs/explorer.png is made.

    python scripts/explorer_screenshot.py SITE N WORD OUT.png

(e.g. SITE N WORD OUT.png = runs/captioner_fashion_scenes/explorer 1 3 docs/explorer.png)
"""

from __future__ import annotations

import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def main(site: str, number: str, word: str, out: str) -> None:
    page_path = Path(site) / "view.html"
    if not page_path.is_file():
        sys.exit(f"{site}: not an explorer site (no view.html); write one with `vision-attn explore`")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=ARGS)
        page = browser.new_page(viewport={"width": 1000, "height": 540})
        page.goto(page_path.resolve().as_uri() + f"?n={int(number)}")
        page.wait_for_selector("body[data-ready='1']")
        page.hover(f"#words button[data-t='{int(word)}']")
        page.screenshot(path=out)
        browser.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
