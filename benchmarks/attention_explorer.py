"""The attention explorer page at its stated size (issue 26): bytes and render time in headless Chromium.

    python benchmarks/attention_explorer.py [--tokens 128] [--repeats 3] [--screenshot PNG --ckpt RUN]

1. A GPT-2-small-shaped GPT (12 layers x 12 heads, d_model 768, random weights, so attention is near
   uniform: the largest page) over `--tokens` tokens of the bundled corpus: `pf.attention_html` at 2 and
   3 decimals. Reported: the page's bytes against the ~2 MB budget (ratio = ours / budget, lower is
   better), and the lower bound of any JSON nested list of its L·H·n·n weights (2 bytes a weight: one
   digit and a comma); then the time headless Chromium takes from navigation to the drawn head view,
   and to the drawn model view (every layer x head), median of `--repeats` loads, against the 2 s
   target (ratio = ours / target).
2. `--screenshot PNG --ckpt RUN`: the page of a trained run (the guide's picture) with one token
   hovered, written by the browser the tests use (tests/reference/browser.py).
Output: a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plainformer as pf
from tests.reference.browser import headless_chromium

BUDGET_BYTES = 2 * 1024 * 1024
TARGET_SECONDS = 2.0
SHAPE = dict(n_layers=12, n_heads=12, d_model=768, d_ff=3072, vocab_size=256, block_size=1024)
SCREENSHOT_TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--screenshot", type=Path, help="write the guide's picture here (needs --ckpt)")
    parser.add_argument("--ckpt", type=Path, help="a trained GPT run or checkpoint for --screenshot")
    parser.add_argument("--hover", type=int, default=18, help="the token hovered in the screenshot")
    args = parser.parse_args(argv)
    if min(args.tokens, args.repeats) < 1:
        parser.error("--tokens and --repeats must be positive")
    if (args.screenshot is None) != (args.ckpt is None):
        parser.error("--screenshot and --ckpt go together")
    return args


def load_seconds(driver, path: Path) -> tuple[float, float]:
    """(navigation -> head view drawn, -> model view drawn) in seconds, as the page's clock says."""
    driver.get(path.as_uri())
    head = driver.execute_script("return document.body.dataset.ready && performance.now()")
    model = driver.execute_script("document.getElementById('view-model').click(); return performance.now()")
    return head / 1000, model / 1000


def measure(args: argparse.Namespace, driver, directory: Path) -> list[dict]:
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**SHAPE)).eval()
    ids = torch.tensor(list(pf.load_text().encode()[:args.tokens]))  # byte ids: one token a byte
    rows = []
    for decimals in (2, 3):
        page = pf.attention_html(model, ids, decimals=decimals)
        path = directory / f"page{decimals}.html"
        path.write_text(page, encoding="utf-8")
        times = [load_seconds(driver, path) for _ in range(args.repeats)]
        rows.append({"decimals": decimals, "bytes": len(page.encode()),
                     "head_view_s": statistics.median(t[0] for t in times),
                     "model_view_s": statistics.median(t[1] for t in times),
                     "console": driver.get_log("browser")})
    return rows


def screenshot(args: argparse.Namespace, driver, directory: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    model = pf.load_model(args.ckpt)
    ids = torch.tensor(model.tokenizer.encode(SCREENSHOT_TEXT))
    path = directory / "screenshot.html"
    path.write_text(pf.attention_html(model, ids, title=f"{args.ckpt.name}: attention"), encoding="utf-8")
    driver.get(path.as_uri())
    token = driver.find_element("css selector", f"#head-svg text.query[data-index='{args.hover}']")
    ActionChains(driver).move_to_element(token).perform()
    args.screenshot.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(args.screenshot))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, headless_chromium() as driver:
        rows = measure(args, driver, Path(tmp))
        if args.screenshot is not None:
            screenshot(args, driver, Path(tmp))
    layers, heads = SHAPE["n_layers"], SHAPE["n_heads"]
    bound = 2 * layers * heads * args.tokens ** 2
    print(f"attention explorer, {layers} layers x {heads} heads x {args.tokens} tokens (GPT, random weights)")
    print(f"{'decimals':>8} {'MB':>7} {'/ 2 MB':>7} {'head view s':>12} {'model view s':>13} {'/ 2 s':>6}")
    for row in rows:
        print(f"{row['decimals']:>8} {row['bytes'] / 2**20:>7.2f} {row['bytes'] / BUDGET_BYTES:>6.2f}x "
              f"{row['head_view_s']:>12.2f} {row['model_view_s']:>13.2f} {row['model_view_s'] / TARGET_SECONDS:>5.2f}x")
    print(f"any JSON list of the {layers * heads * args.tokens ** 2:,} weights: >= {bound / 2**20:.2f} MB")
    print(json.dumps({"tokens": args.tokens, "layers": layers, "heads": heads, "json_list_bound_bytes": bound,
                      "pages": rows, "screenshot": None if args.screenshot is None else str(args.screenshot)}))


if __name__ == "__main__":
    main()
