"""The chat page at `/` in a real browser (issue 45): headless Chromium driven by selenium
against the live server of scripts/test-server.sh (which has an API key, so the page must ask
for it). scripts/test-server.sh installs Debian's `chromium` and `chromium-driver` when it
can; without them, or without selenium, these tests skip with the reason.

With PAGODA_WEBUI_SCREENSHOT=FILE the page is photographed there (docs/webui.png is made so).

The tests run in order on one browser: each continues the page the one before left.
"""

import json
import os
import shutil
import time

import pytest
import requests

selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

# Records every request the page sends (URL, headers, JSON body) in window.__requests.
RECORD_FETCH = """
window.__requests = [];
const original = window.fetch;
window.fetch = (url, options = {}) => {
  window.__requests.push({url: String(url), headers: options.headers || {}, body: options.body || null});
  return original(url, options);
};
"""

# Adds `ignore_eos` to the page's chat requests (restored by `window.fetch = window.__plainFetch`).
IGNORE_EOS = """
window.__plainFetch = window.fetch;
window.fetch = (url, options = {}) => {
  if (String(url).endsWith("/v1/chat/completions") && options.body) {
    options = {...options, body: JSON.stringify({...JSON.parse(options.body), ignore_eos: true})};
  }
  return window.__plainFetch(url, options);
};
"""


@pytest.fixture(scope="module")
def browser(base_url):
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip("no chromium/chromedriver: apt-get install chromium chromium-driver "
                    "(scripts/test-server.sh does when it runs as root)")
    page = requests.get(f"{base_url}/", timeout=10)
    if page.status_code == 404:
        pytest.skip("the server runs with --no-webui")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1100,760", "--force-device-scale-factor=1"):
        options.add_argument(argument)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def wait(driver, condition, timeout=20, message=""):
    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(
        lambda d: condition(d), message)


def js(driver, script, *args):
    return driver.execute_script(script, *args)


def last_reply(driver):
    """The text and stats line of the last assistant message ("" and "" when none)."""
    return js(driver, """
        const all = document.querySelectorAll('.message.assistant');
        const last = all[all.length - 1];
        return last ? [last.querySelector('.content').textContent,
                       last.querySelector('.meta').textContent] : ['', ''];""")


def replies(driver):
    return js(driver, "return document.querySelectorAll('.message.assistant').length")


def type_message(driver, text):
    prompt = driver.find_element(By.ID, "prompt")
    prompt.send_keys(text)
    prompt.send_keys(Keys.ENTER)  # Enter sends


def set_setting(driver, field, value):
    if not driver.find_element(By.ID, "settings").is_displayed():
        driver.find_element(By.ID, "settings-toggle").click()
    element = driver.find_element(By.ID, field)
    element.clear()
    element.send_keys(str(value) + Keys.TAB)  # the change event saves it


def close_settings(driver):
    if driver.find_element(By.ID, "settings").is_displayed():
        driver.find_element(By.ID, "settings-close").click()


def test_page_asks_for_the_key_then_shows_the_model(browser, base_url, api_key, model):
    browser.get(base_url + "/")
    js(browser, "localStorage.clear()")
    browser.refresh()
    if api_key:
        dialog = browser.find_element(By.ID, "key-dialog")
        wait(browser, lambda d: dialog.get_attribute("open") is not None, 10,
             "no API key prompt after the server's 401")
        browser.find_element(By.ID, "api-key").send_keys(api_key + Keys.ENTER)
    wait(browser, lambda d: d.find_element(By.ID, "model-name").text == model, 10,
         "the model name from /v1/models did not appear")
    context = requests.get(f"{base_url}/props", headers={"Authorization": f"Bearer {api_key}"},
                           timeout=10).json()["default_generation_settings"]["n_ctx"]
    assert browser.find_element(By.ID, "context-size").text == f"context {context} tokens"
    # The sampling settings are prefilled with the server's defaults.
    assert browser.find_element(By.ID, "temperature").get_attribute("value") != ""
    assert browser.find_element(By.ID, "top-k").get_attribute("value") != ""
    assert js(browser, "return localStorage.getItem('pagoda.apiKey')") == json.dumps(api_key)


def test_markdown_is_rendered_and_model_html_escaped(browser):
    html = js(browser, "return renderMarkdown(arguments[0])",
              "# Title\nSome **bold** and *it* and `x<y`.\n\n- one\n- two\n\n"
              "```python\nprint('<b>')\n```\n<img src=x onerror=alert(1)> "
              "[ok](https://example.org) [bad](javascript:alert(1))")
    for expected in ("<h1>Title</h1>", "<strong>bold</strong>", "<em>it</em>",
                     "<code>x&lt;y</code>", "<ul><li>one</li><li>two</li></ul>",
                     '<pre data-lang="python"><code>print(&#39;&lt;b&gt;&#39;)</code></pre>',
                     "&lt;img src=x onerror=alert(1)&gt;", '<a href="https://example.org"'):
        assert expected in html, f"{expected!r} not in {html!r}"
    assert 'href="javascript' not in html, "only http(s) and mailto links are made"
    assert "<img" not in html


def test_reply_streams_and_ends_with_the_speed(browser):
    set_setting(browser, "max-tokens", 90)
    set_setting(browser, "seed", 7)
    close_settings(browser)
    type_message(browser, "Write a Python function that reverses a string, and explain it.")
    # Observe the text growing while the stats line is still empty.
    lengths = []
    deadline = time.time() + 60
    while time.time() < deadline:
        text, meta = last_reply(browser)
        if meta:
            break
        if text and (not lengths or len(text) != lengths[-1]):
            lengths.append(len(text))
        time.sleep(0.01)
    assert len(lengths) >= 2 and lengths[-1] > lengths[0], \
        f"the reply did not grow while streaming (lengths seen: {lengths})"
    wait(browser, lambda d: "tokens/s" in last_reply(d)[1], 60, "no tokens-per-second line")
    text, meta = last_reply(browser)
    assert text.strip() and "first token" in meta, meta
    assert not browser.find_element(By.ID, "stop").is_displayed()
    assert browser.find_element(By.ID, "send").is_displayed()


def test_stop_ends_a_long_reply_midway(browser):
    set_setting(browser, "max-tokens", 800)
    close_settings(browser)
    browser.find_element(By.ID, "new-chat").click()
    js(browser, IGNORE_EOS)  # the reply cannot end by itself before Escape is pressed
    try:
        type_message(browser, "Count from one to one thousand, one number a line.")
        wait(browser, lambda d: len(last_reply(d)[0]) > 20, 60, "the long reply did not start")
        assert not last_reply(browser)[1], "the reply ended before Escape"
        assert browser.find_element(By.ID, "stop").is_displayed()
        browser.find_element(By.ID, "prompt").send_keys(Keys.ESCAPE)  # Escape stops
        wait(browser, lambda d: "stopped" in last_reply(d)[1], 10,
             "Escape did not stop the reply")
    finally:
        js(browser, "window.fetch = window.__plainFetch;")
    text, meta = last_reply(browser)
    time.sleep(0.5)
    assert last_reply(browser)[0] == text, "the reply kept growing after it was stopped"
    tokens = int(meta.split()[0])
    assert 0 < tokens < 800, meta
    assert browser.find_element(By.ID, "send").is_displayed()


def test_settings_and_key_go_into_the_request(browser, api_key):
    set_setting(browser, "temperature", 0.35)
    set_setting(browser, "max-tokens", 8)
    set_setting(browser, "system-prompt", "You are terse.")
    close_settings(browser)
    js(browser, RECORD_FETCH)
    count = replies(browser)
    type_message(browser, "Say hello.")
    wait(browser, lambda d: replies(d) > count and last_reply(d)[1], 60, "no reply")
    sent = [r for r in js(browser, "return window.__requests")
            if r["url"].endswith("/v1/chat/completions")]
    assert len(sent) == 1, sent
    body = json.loads(sent[0]["body"])
    assert body["temperature"] == 0.35 and body["max_tokens"] == 8, body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"][0] == {"role": "system", "content": "You are terse."}
    assert body["messages"][-1] == {"role": "user", "content": "Say hello."}
    assert body["messages"][-2]["role"] == "assistant", "the conversation so far is sent"
    if api_key:
        assert sent[0]["headers"].get("Authorization") == f"Bearer {api_key}"
    # Regenerate asks again for the last message: one more request, the same reply count.
    count = replies(browser)
    browser.find_element(By.ID, "regenerate").click()
    wait(browser, lambda d: len(d.execute_script("return window.__requests")) == 2
         and last_reply(d)[1] and not d.find_element(By.ID, "stop").is_displayed(), 60,
         "regenerate sent no request")
    assert replies(browser) == count


def test_conversations_survive_a_reload(browser):
    before = js(browser, """return [...document.querySelectorAll('#conversations .open')]
                            .map(b => b.textContent)""")
    thread = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#thread .message .content")]
    assert len(before) == 2 and thread, (before, thread)
    browser.refresh()
    wait(browser, lambda d: d.find_element(By.ID, "model-name").text not in ("", "…"), 10)
    after = js(browser, """return [...document.querySelectorAll('#conversations .open')]
                           .map(b => b.textContent)""")
    assert after == before
    assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#thread .message .content")] \
        == thread
    assert "tokens/s" in last_reply(browser)[1], "the stats line is kept too"
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0.35"
    # The first conversation opens from the list.
    browser.find_elements(By.CSS_SELECTOR, "#conversations .open")[1].click()
    assert "reverses" in browser.find_element(By.CSS_SELECTOR, "#thread .message.user").text
    screenshot = os.environ.get("PAGODA_WEBUI_SCREENSHOT")
    if screenshot:
        browser.save_screenshot(screenshot)


def test_server_errors_are_shown(browser, base_url, api_key):
    context = requests.get(f"{base_url}/props", headers={"Authorization": f"Bearer {api_key}"},
                           timeout=10).json()["default_generation_settings"]["n_ctx"]
    set_setting(browser, "max-tokens", context + 100)
    close_settings(browser)
    count = replies(browser)
    type_message(browser, "This asks for more tokens than the context holds.")
    error = browser.find_element(By.ID, "error")
    wait(browser, lambda d: error.is_displayed(), 20, "the 400 was not shown")
    text = browser.find_element(By.ID, "error-text").text
    assert "400" in text and "context" in text, text
    assert replies(browser) == count, "no empty reply is left behind"
    # A wrong key: the page asks for the key again, with the server's reason.
    js(browser, "localStorage.setItem('pagoda.apiKey', JSON.stringify('wrong-key'))")
    set_setting(browser, "max-tokens", 4)
    close_settings(browser)
    browser.find_element(By.ID, "regenerate").click()
    if api_key:
        dialog = browser.find_element(By.ID, "key-dialog")
        wait(browser, lambda d: dialog.get_attribute("open") is not None, 10, "no key prompt")
        assert "wrong" in browser.find_element(By.ID, "key-reason").text
        browser.find_element(By.ID, "api-key").send_keys(api_key + Keys.ENTER)
        wait(browser, lambda d: replies(d) == count + 1 and last_reply(d)[1], 60,
             "no reply after the key was given again")
