"""The built-in web chat at `/`, driven in headless Chromium (Playwright) against a real demo server.

The page is used as a person would: draw a shapes picture, send its question, read the streamed answer
(checked against the generator's answer, rebuilt here from the seed and index the page shows), ask a
second question about the same picture (the answer's stats must show an encoder-cache hit), stop a long
answer mid-stream (the server must end up with nothing running and nothing held), and upload a file
that is not an image (the server's error message must be shown). The page must log no console error
but the one that answer's 400 causes. A screenshot of the chat is saved as an artifact.

Browser and driver: Debian's chromium (`/usr/bin/chromium`, installed by scripts/setup.sh) driven by
the `playwright` wheel; the tests skip only when one of them is missing.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from mmserve.demo import shapes
from mmserve.entrypoints.openai.web_ui import WEB_UI_DIR
from tests.e2e.conftest import running_server

CHROMIUM = Path("/usr/bin/chromium")
# the closed network refuses Chromium's background connections; these flags stop it trying
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# a held-out sample (seed below shapes.TRAIN_SEED_BASE) that the demo model answers right, greedily
DEMO_SEED, DEMO_INDEX, DEMO_QUESTION_TYPE = 7, 3, "describe"
ANSWER_TIMEOUT_MS = 30_000
LONG_ANSWER_TOKENS = 1500  # with ignore_eos: seconds of decoding on the demo model, stopped after a few
NOT_AN_IMAGE = b"this is plain text, not a picture\n" * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(None, tmp_path_factory.mktemp("logs") / "web-ui.log") as server:
        yield server


def chromium(extra_args: tuple[str, ...] = ()):
    """Headless Chromium (Debian's) with `extra_args`, closed after the module's tests."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is missing (scripts/setup.sh installs Debian's chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=[*CHROMIUM_ARGS, *extra_args])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


def png_data_uri(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _stats(server) -> dict:
    return httpx.get(server.url + "/v1/stats", timeout=5).json()


def _wait_idle(server, timeout_s: float) -> dict:
    """Poll /v1/stats until no request runs or waits and nothing holds KV blocks or encoder outputs."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _stats(server)
        idle = (stats["requests_running"] == 0 and stats["requests_waiting"] == 0
                and stats["kv_blocks_free"] == stats["kv_blocks_total"]
                and stats["encoder_cache_bytes_referenced"] == 0)
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _last_answer(page):
    return page.locator("article.message.assistant").last


def _send(page, text: str | None = None) -> None:
    if text is not None:
        page.fill("#prompt", text)
    page.focus("#prompt")
    page.keyboard.press("Enter")  # Enter sends (Shift+Enter would add a line)


def _wait_done(page, expected: str = "ok") -> None:
    answer = _last_answer(page)
    answer.and_(page.locator("[data-done]")).wait_for(timeout=ANSWER_TIMEOUT_MS)
    assert answer.get_attribute("data-done") == expected, answer.inner_text()


def test_chat_in_the_browser(server, browser, tmp_path):
    page = browser.new_page(viewport={"width": 900, "height": 1400})
    console_errors: list[tuple[str, str]] = []  # (step, text)
    step = "load"
    page.on("console", lambda m: console_errors.append((step, m.text)) if m.type == "error" else None)
    page.on("pageerror", lambda exc: console_errors.append((step, f"uncaught: {exc}")))
    # the picture the button draws is random; pin it to a sample whose answer is known to be right
    pinned = f"{server.url}/demo/sample?seed={DEMO_SEED}&index={DEMO_INDEX}&question_type={DEMO_QUESTION_TYPE}"
    page.route("**/demo/sample", lambda route: route.continue_(url=pinned))
    long_answers = {"on": False}  # a test-only rewrite of the page's request: stop needs a long answer

    def chat_request(route, request):
        if not long_answers["on"]:
            return route.continue_()
        body = json.loads(request.post_data)
        body.update(max_tokens=LONG_ANSWER_TOKENS, ignore_eos=True)
        return route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", chat_request)

    page.goto(server.url + "/")
    page.wait_for_selector("body[data-ready=true]")
    assert page.inner_text("#model-name") == "mmserve-demo"
    assert page.locator("#api-key").is_hidden()  # the server needs no key

    step = "demo picture"
    page.click("#demo-button")
    page.wait_for_selector("#attachments img")
    sample = shapes.make_sample(seed=DEMO_SEED, index=DEMO_INDEX, question_type=DEMO_QUESTION_TYPE)
    assert page.input_value("#prompt") == sample.question
    _send(page)
    _wait_done(page)
    user = page.locator("article.message.user").last
    shown = [user.get_attribute(f"data-demo-{name}") for name in ("seed", "index", "question-type")]
    assert shown == [str(DEMO_SEED), str(DEMO_INDEX), DEMO_QUESTION_TYPE]  # what rebuilds the picture
    assert _last_answer(page).locator(".text").inner_text() == sample.answer
    stats_line = _last_answer(page).locator(".stats").inner_text()
    assert re.search(r"TTFT \d+ ms", stats_line) and re.search(r"[\d.]+ tokens/s", stats_line), stats_line
    assert "matches" in stats_line  # the page compares with the generator's answer too
    cache = _last_answer(page).locator(".cache")
    assert cache.get_attribute("data-mm-items") == "1"

    step = "second question"
    _send(page, "How many shapes are there?")  # about the same picture: it is in the conversation
    _wait_done(page)
    cache = _last_answer(page).locator(".cache")
    assert cache.get_attribute("data-cached-mm-items") == "1", cache.inner_text()
    assert "encoder cache: hit" in cache.inner_text()

    step = "stop"
    tokens_before = _stats(server)["generation_tokens"]
    long_answers["on"] = True
    _send(page, "Describe the image.")
    page.locator("#stop-button").wait_for(state="visible")
    _last_answer(page).locator(".text").filter(has_text=re.compile(r"\w")).wait_for(timeout=ANSWER_TIMEOUT_MS)
    page.click("#stop-button")
    _wait_done(page, "stopped")
    long_answers["on"] = False
    stats = _wait_idle(server, timeout_s=3.0)
    # freed by the stop, not by running to the end
    assert stats["generation_tokens"] - tokens_before < LONG_ANSWER_TOKENS // 2, stats
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert stats["encoder_cache_bytes_referenced"] == 0, stats
    assert "stopped" in _last_answer(page).locator(".stats").inner_text()

    step = "corrupt upload"
    page.set_input_files("#file-input", files=[{"name": "broken.png", "mimeType": "image/png",
                                               "buffer": NOT_AN_IMAGE}])
    page.wait_for_selector("#attachments img")
    _send(page, "What is this?")
    _wait_done(page, "error")
    error = _last_answer(page).locator(".text").inner_text()
    # the server's error.message, naming the part: the upload is this turn's first part
    assert re.match(r"400: messages\[\d+\]\.content\[0\]\.image_url could not be decoded", error), error
    assert _last_answer(page).get_attribute("role") == "alert"
    step = "after"

    shot = tmp_path / "web-ui.png"
    page.screenshot(path=str(shot))
    print(f"screenshot of the chat: {shot}")
    # the 400 answer is the only thing the browser may log (Chromium logs every failed fetch)
    unexpected = [(s, text) for s, text in console_errors
                  if not (s == "corrupt upload" and "status of 400" in text)]
    assert not unexpected, unexpected
    print(f"console errors (expected): {console_errors}")
    page.close()


DROP_AND_PASTE_JS = """async (pngBase64) => {
  const bytes = Uint8Array.from(atob(pngBase64), (c) => c.charCodeAt(0));
  const transfer = (name) => {
    const data = new DataTransfer();
    data.items.add(new File([bytes], name, { type: "image/png" }));
    return data;
  };
  document.dispatchEvent(new DragEvent("drop", { dataTransfer: transfer("dropped.png"), bubbles: true,
                                                  cancelable: true }));
  document.dispatchEvent(new ClipboardEvent("paste", { clipboardData: transfer("pasted.png"), bubbles: true,
                                                       cancelable: true }));
}"""


def test_keyboard_phone_width_drop_and_paste(server, browser):
    page = browser.new_page(viewport={"width": 360, "height": 740})
    console_errors: list[str] = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: console_errors.append(f"uncaught: {exc}"))
    page.goto(server.url + "/")
    page.wait_for_selector("body[data-ready=true]")
    # nothing wider than the screen: no sideways scrolling at phone width
    assert page.evaluate("document.documentElement.scrollWidth") <= 360
    # the demo model takes no audio: no audio buttons (test_web_ui_audio.py drives them on Gemma 4)
    assert page.locator("#audio-button").is_hidden() and page.locator("#record-button").is_hidden()
    for control in ("#prompt", "#temperature", "#max-tokens"):  # every field has a label
        assert page.locator(f"label[for='{control[1:]}']").count() == 1
    page.focus("#prompt")
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#prompt") == "line one\nline two"  # Shift+Enter did not send
    assert page.locator("article.message").count() == 0
    page.keyboard.press("Tab")  # the buttons are reachable from the keyboard
    focused = page.evaluate("document.activeElement.id")
    assert focused == "pick-button", focused

    picture = png_data_uri(shapes.make_sample(seed=7, index=0).images[0]).split(",", 1)[1]
    page.evaluate(DROP_AND_PASTE_JS, picture)
    thumbnails = page.locator("#attachments img")
    thumbnails.nth(1).wait_for()
    assert [thumbnails.nth(i).get_attribute("alt") for i in range(2)] == ["dropped.png", "pasted.png"]
    page.focus("button[aria-label='Remove dropped.png']")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelectorAll('#attachments img').length === 1")
    assert page.locator("#attachments img").get_attribute("alt") == "pasted.png"
    assert not console_errors, console_errors
    page.close()


def test_api_key_field_when_the_server_requires_one(browser, tmp_path):
    with running_server(None, tmp_path / "api-key.log", api_key="sesame") as keyed:
        page = browser.new_page()
        console_errors: list[str] = []
        page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
        page.goto(keyed.url + "/")
        page.wait_for_selector("body[data-ready=true]")
        assert page.locator("#api-key").is_visible()
        assert page.locator("#demo-button").is_visible()  # the picture endpoint needs no key
        _send(page, "How many shapes are there?")  # no key yet: the server's 401 message is shown
        _wait_done(page, "error")
        assert "401: Incorrect or missing API key" in _last_answer(page).inner_text()
        page.fill("#api-key", "sesame")
        page.press("#api-key", "Tab")  # a change event: the page lists the models with the key
        page.wait_for_function("document.getElementById('model-name').textContent === 'mmserve-demo'")
        page.click("#demo-button")
        page.wait_for_selector("#attachments img")
        page.click("#send-button")
        _wait_done(page)
        assert all("status of 401" in text for text in console_errors), console_errors
        page.close()


def test_usage_says_which_images_the_caches_served(server):
    """No browser: the usage fields the page shows (`prompt_tokens_details` extensions)."""
    sample = shapes.make_sample(seed=11, index=1)  # a picture no other test here sends
    image = {"type": "image_url", "image_url": {"url": png_data_uri(sample.images[0])}}

    def usage(content: list[dict]) -> dict:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}  # 4 tokens: a decode speed to measure
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["completion_tokens"] == 4
        assert usage["time_to_first_token_ms"] > 0 and usage["decode_tokens_per_s"] > 0, usage
        return usage["prompt_tokens_details"]

    first = usage([image, {"type": "text", "text": "How many shapes are there?"}])
    assert (first["mm_items"], first["cached_mm_items"], first["prefix_cached_mm_items"]) == (1, 0, 0)
    again = usage([image, {"type": "text", "text": "Describe the image."}])
    assert (again["mm_items"], again["cached_mm_items"]) == (1, 1)
    text = usage([{"type": "text", "text": "Hello"}])
    assert (text["mm_items"], text["cached_mm_items"], text["prefix_cached_mm_items"]) == (0, 0, 0)


def test_page_is_self_contained_and_can_be_turned_off(server, tmp_path):
    assert f"chat in your browser: {server.url}/" in server.log()  # what `bash scripts/run.sh` shows
    page = httpx.get(server.url + "/", timeout=5)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in ("app.js", "style.css"):
        assert httpx.get(f"{server.url}/web-ui/{name}", timeout=5).status_code == 200
    assert httpx.get(f"{server.url}/web-ui/..%2Fweb_ui.py", timeout=5).status_code == 404
    # no file the page loads refers to another host: nothing is fetched from outside at run time
    for path in WEB_UI_DIR.iterdir():
        for url in re.findall(r"https?://[^\s\"'`)<>]+", path.read_text()):
            assert urlparse(url).hostname in ("127.0.0.1", "localhost"), f"{path.name} refers to {url}"
    config = httpx.get(server.url + "/web-ui/config.json", timeout=5).json()
    assert config == {"demo_model": True, "api_key_required": False, "input_modalities": ["image", "video"]}
    sample = httpx.get(server.url + "/demo/sample", params={"seed": 7, "index": 0}, timeout=10).json()
    expected = shapes.make_sample(7, 0)
    assert (sample["question"], sample["answer"]) == (expected.question, expected.answer)
    assert sample["images"][0].startswith("data:image/png;base64,")

    with running_server(None, tmp_path / "no-web-ui.log", "--no-web-ui") as off:
        for route in ("/", "/web-ui/app.js", "/demo/sample"):
            response = httpx.get(off.url + route, timeout=5)
            assert response.status_code == 404, route
            assert response.json()["error"]["type"] == "not_found_error"
        assert httpx.get(off.url + "/v1/models", timeout=5).status_code == 200
        assert "chat in your browser" not in off.log()
