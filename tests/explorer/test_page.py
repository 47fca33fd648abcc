"""The attention explorer page: its embedded data against `attention_maps` and softmax(logits), and the page
itself in headless Chromium (Debian's chromium + chromium-driver through selenium): it loads from file://
with no console message and no network request, and what it draws follows the controls, the hovered token
and the clicked map.

Outside CI the browser tests skip when no browser is installed; in CI (`CI` set) a missing browser fails."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import plainformer as pf
from plainformer.explorer.page import attention_data, token_label, token_labels
from tests.reference.browser import headless_chromium, missing_browser

ROUNDING = 0.5e-3  # the page's weights are rounded to 3 decimals
TOLERANCE = 1e-4  # embedded (rounded) weights against the rounded maps; top-5 probabilities against softmax
TEXT = "To be, or not\tto be:\nthat is"


def _sharpened(model: torch.nn.Module) -> torch.nn.Module:
    """Larger weights than the init, so that the maps are far from uniform and differ between heads."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.4)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer() -> pf.CharTokenizer:
    return pf.CharTokenizer(TEXT + "</script>&")


@pytest.fixture(scope="module")
def gpt(tokenizer) -> pf.GPT:
    torch.manual_seed(0)
    config = pf.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layers=2, n_heads=3, d_model=24,
                          d_ff=48)
    model = _sharpened(pf.GPT(config))
    model.tokenizer = tokenizer
    return model


@pytest.fixture(scope="module")
def bpe() -> pf.BPETokenizer:
    return pf.BPETokenizer.train(pf.load_text()[:50_000], 300, special_tokens=("pad", "bos", "eos"))


@pytest.fixture(scope="module")
def transformer(bpe) -> pf.Transformer:
    torch.manual_seed(0)
    config = pf.TransformerConfig(src_vocab_size=bpe.vocab_size, tgt_vocab_size=bpe.vocab_size, max_len=32,
                                  n_layers=2, n_heads=2, d_model=16, d_ff=32, pad_id=bpe.pad_id,
                                  bos_id=bpe.bos_id, eos_id=bpe.eos_id)
    return _sharpened(pf.Transformer(config))


def _embedded(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="attention-data">(.*?)</script>', page, re.S)
    assert match is not None
    return json.loads(match.group(1))


def _assert_rounded_equal(embedded: list, maps: torch.Tensor) -> None:
    got = torch.tensor(embedded, dtype=torch.float64)
    assert got.shape == maps.shape
    assert (got - (maps.double() * 1000).round() / 1000).abs().max().item() <= TOLERANCE
    assert (got - maps.double()).abs().max().item() <= ROUNDING + 1e-6


# ----------------------------------------------------------------------------- the data

def test_gpt_page_embeds_the_maps_rounded_and_the_softmax_top5(gpt, tokenizer):
    ids = torch.tensor(tokenizer.encode(TEXT))
    data = _embedded(pf.attention_html(gpt, ids))
    maps = pf.attention_maps(gpt, ids)
    assert (data["layers"], data["heads"], data["decimals"]) == (2, 3, 3)
    _assert_rounded_equal(data["weights"], maps)
    assert maps.max() > 0.5  # far from uniform: the comparison can fail
    with torch.no_grad():
        probabilities = torch.softmax(gpt(ids[None])[0][0].double(), dim=-1)
    top = probabilities.topk(5, dim=-1)
    for position, row in enumerate(data["next_tokens"]):
        assert [token for token, _ in row] == token_labels(tokenizer, top.indices[position].tolist())
        assert torch.tensor([p for _, p in row]).sub(top.values[position]).abs().max() <= TOLERANCE
    assert data["tokens"][:6] == ["T", "o", "\u2423", "b", "e", ","]
    assert "\u21e5" in data["tokens"] and "\u23ce" in data["tokens"]


def test_bert_page_embeds_its_self_attention():
    torch.manual_seed(0)
    bert = _sharpened(pf.BertModel(pf.BertConfig(vocab_size=40, max_len=16, n_layers=2, n_heads=2, d_model=16,
                                                 d_ff=32)))
    ids = torch.randint(0, 40, (9,), generator=torch.Generator().manual_seed(1))
    data = _embedded(pf.attention_html(bert, ids))
    _assert_rounded_equal(data["weights"], pf.attention_maps(bert, ids))
    assert data["tokens"] == [str(i) for i in ids.tolist()] and "next_tokens" not in data  # no tokenizer: the ids


def test_encoder_decoder_page_embeds_encoder_decoder_and_cross_attention(transformer, bpe):
    src = torch.tensor(bpe.encode("the king is dead"))
    tgt = torch.tensor([bpe.bos_id, *bpe.encode("der König")])
    data = attention_data(transformer, src, tgt, tokenizer=bpe)
    maps = pf.all_attention_maps(transformer, src, tgt)
    _assert_rounded_equal(data["weights_cross"], pf.attention_maps(transformer, src, tgt))
    _assert_rounded_equal(data["weights_encoder"], maps["encoder"])
    _assert_rounded_equal(data["weights"], maps["decoder"])
    assert data["target_tokens"][0] == "<bos>"
    assert "".join(data["source_tokens"]) == "the\u2423king\u2423is\u2423dead"


def test_page_is_self_contained_and_its_data_cannot_close_the_script(gpt, tokenizer):
    ids = torch.tensor(tokenizer.encode("</script><&>"))
    page = pf.attention_html(gpt, ids, title="<b>title</b>")
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"\bsrc\s*=", page) and "@import" not in page and "url(" not in page
    assert page.count("</script>") == 2  # the data's and the code's own ends, nothing from the tokens
    assert "<b>title" not in page
    assert _embedded(page)["tokens"] == list("</script><&>")


def test_labels_show_special_tokens_by_name_and_byte_level_pieces_as_bytes(bpe):
    piece = next(i for i in range(bpe.vocab_size) if "\ufffd" in bpe.decode([i]))  # a lone UTF-8 byte
    assert re.fullmatch(r"(\\x[0-9a-f]{2})+", token_label(bpe, piece))
    assert token_labels(bpe, [bpe.eos_id, *bpe.encode(" the\n")])[0] == "<eos>"
    assert "".join(token_labels(bpe, bpe.encode(" the\n"))) == "\u2423the\u23ce"


@pytest.mark.parametrize("call, message", [
    (lambda m, ids: attention_data(m, ids, decimals=0), r"decimals must be an int in \[1, 6\]"),
    (lambda m, ids: attention_data(torch.nn.Linear(2, 2), ids), "GPT, a BERT or a Transformer"),
    (lambda m, ids: attention_data(m, ids[None].repeat(2, 1)), "one sequence"),
])
def test_bad_arguments_are_refused(gpt, call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(gpt, torch.tensor([1, 2, 3]))


# ----------------------------------------------------------------------------- the page in a browser

@pytest.fixture(scope="module")
def browser():
    reason = missing_browser()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests: {reason}")
        pytest.skip(reason)
    with headless_chromium() as driver:
        yield driver


def _open(driver, page: str, path) -> None:
    path.write_text(page, encoding="utf-8")
    driver.get_log("browser")  # what an earlier page logged
    driver.get(path.as_uri())
    assert driver.execute_script("return document.body.dataset.ready") == "true"


def _drawn(driver) -> list[dict]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#lines line')].map(l => ({head: +l.dataset.head, "
        "query: +l.dataset.query, key: +l.dataset.key, weight: +l.dataset.weight, "
        "opacity: +l.getAttribute('stroke-opacity')}))")


def _hover(driver, side: str, index: int) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    token = driver.find_element("css selector", f"#head-svg text.{side}[data-index='{index}']")
    ActionChains(driver).move_to_element(token).perform()


def _row(lines: list[dict], head: int, query: int) -> list[float]:
    return [line["weight"] for line in sorted(lines, key=lambda line: line["key"])
            if line["head"] == head and line["query"] == query]


def test_page_loads_from_file_with_no_console_message_and_no_network_request(browser, gpt, tokenizer, tmp_path):
    path = tmp_path / "attention.html"
    browser.get_log("performance")
    _open(browser, pf.attention_html(gpt, torch.tensor(tokenizer.encode(TEXT))), path)
    assert browser.get_log("browser") == []
    requested = {json.loads(entry["message"])["message"]["params"]["request"]["url"]
                 for entry in browser.get_log("performance")
                 if json.loads(entry["message"])["message"]["method"] == "Network.requestWillBeSent"}
    assert {url for url in requested if not url.startswith("data:")} == {path.as_uri()}


def test_hovering_a_query_shows_exactly_its_row_and_the_top5_next_tokens(browser, gpt, tokenizer, tmp_path):
    ids = torch.tensor(tokenizer.encode(TEXT))
    data = attention_data(gpt, ids)
    _open(browser, pf.attention_html(gpt, ids), tmp_path / "gpt.html")
    _hover(browser, "query", 7)
    lines = _drawn(browser)
    assert {line["query"] for line in lines} == {7} and len(lines) == 3 * len(ids)
    for head in range(3):
        assert _row(lines, head, 7) == data["weights"][0][head][7]
    assert all(line["opacity"] == line["weight"] for line in lines)
    items = browser.find_elements("css selector", "#next-tokens li")
    shown = [(item.get_attribute("data-token"), float(item.get_attribute("data-probability"))) for item in items]
    assert shown == [tuple(pair) for pair in data["next_tokens"][7]]


def test_keyboard_moves_the_focused_row(browser, gpt, tokenizer, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    ids = torch.tensor(tokenizer.encode(TEXT))
    _open(browser, pf.attention_html(gpt, ids), tmp_path / "gpt.html")
    browser.execute_script("document.querySelector(\"#head-svg text.query[data-index='2']\").focus()")
    ActionChains(browser).send_keys(Keys.ARROW_DOWN).perform()
    assert {line["query"] for line in _drawn(browser)} == {3}
    ActionChains(browser).send_keys(Keys.ARROW_RIGHT).perform()  # to key 3: its column
    assert {line["key"] for line in _drawn(browser)} == {3}
    ActionChains(browser).send_keys(Keys.ESCAPE).perform()
    assert browser.find_element("id", "lines").get_attribute("data-focus") == ""


def test_another_layer_or_head_changes_what_is_drawn(browser, gpt, tokenizer, tmp_path):
    from selenium.webdriver.support.select import Select

    ids = torch.tensor(tokenizer.encode(TEXT))
    _open(browser, pf.attention_html(gpt, ids), tmp_path / "gpt.html")
    view = browser.find_element("id", "head-view")
    before = _drawn(browser)
    Select(browser.find_element("id", "layer")).select_by_value("1")
    assert view.get_attribute("data-layer") == "1" and _drawn(browser) != before
    browser.find_element("css selector", ".head-toggle:nth-of-type(2) span").click()  # head 1 off
    assert view.get_attribute("data-heads") == "0,2"
    assert {line["head"] for line in _drawn(browser)} <= {0, 2}


def test_clicking_a_model_view_map_opens_that_head(browser, gpt, tokenizer, tmp_path):
    ids = torch.tensor(tokenizer.encode(TEXT))
    _open(browser, pf.attention_html(gpt, ids), tmp_path / "gpt.html")
    browser.find_element("id", "view-model").click()
    cells = browser.find_elements("css selector", "#model-grid canvas")
    assert len(cells) == 2 * 3
    browser.find_element("css selector", "#model-grid canvas[data-layer='1'][data-head='2']").click()
    view = browser.find_element("id", "head-view")
    assert view.is_displayed() and not browser.find_element("id", "model-view").is_displayed()
    assert (view.get_attribute("data-layer"), view.get_attribute("data-heads")) == ("1", "2")
    assert {line["head"] for line in _drawn(browser)} == {2}


def test_bert_page_hover_shows_the_row_of_its_self_attention(browser, tmp_path):
    torch.manual_seed(0)
    bert = _sharpened(pf.BertModel(pf.BertConfig(vocab_size=40, max_len=16, n_layers=2, n_heads=2, d_model=16,
                                                 d_ff=32)))
    ids = torch.randint(0, 40, (9,), generator=torch.Generator().manual_seed(1))
    data = attention_data(bert, ids)
    _open(browser, pf.attention_html(bert, ids), tmp_path / "bert.html")
    _hover(browser, "query", 4)
    lines = _drawn(browser)
    assert [_row(lines, h, 4) for h in range(2)] == [data["weights"][0][h][4] for h in range(2)]
    assert not browser.find_element("id", "next-panel").is_displayed()  # no next tokens for a BERT


def test_encoder_decoder_page_shows_cross_then_encoder_attention(browser, transformer, bpe, tmp_path):
    from selenium.webdriver.support.select import Select

    src = torch.tensor(bpe.encode("the king is dead"))
    tgt = torch.tensor([bpe.bos_id, *bpe.encode("der König")])
    data = attention_data(transformer, src, tgt, tokenizer=bpe)
    _open(browser, pf.attention_html(transformer, src, tgt, tokenizer=bpe), tmp_path / "seq2seq.html")
    assert len(browser.find_elements("css selector", "#head-svg text.query")) == len(tgt)
    assert len(browser.find_elements("css selector", "#head-svg text.key")) == len(src)
    _hover(browser, "query", 2)
    lines = _drawn(browser)
    assert [_row(lines, h, 2) for h in range(2)] == [data["weights_cross"][0][h][2] for h in range(2)]
    Select(browser.find_element("id", "kind")).select_by_visible_text("encoder self-attention")
    assert browser.find_element("id", "head-view").get_attribute("data-attention") == "encoder"
    assert len(browser.find_elements("css selector", "#head-svg text.query")) == len(src)
    _hover(browser, "query", 1)
    assert _row(_drawn(browser), 1, 1) == data["weights_encoder"][0][1][1]
