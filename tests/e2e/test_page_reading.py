"""Reading while a reply streams, and Markdown as models write it, in a real Chromium:
the list does not jump or lose a selection, follows the bottom only while the reader is
there, and replies render CommonMark + GFM with highlighted code and no model markup."""

import pytest

from tests.e2e.page_util import fake_server, open_page, send, set_setting, wait_reply_done

LONG = "\n\n".join(f"Paragraph {i} of a long answer, streaming in." for i in range(400))


@pytest.fixture(scope="module")
def server(tokenizer):
    with fake_server(tokenizer) as s:
        yield s


def test_scrolled_up_the_list_stays_put_and_a_selection_survives(browser, server):
    page = open_page(browser, server)
    server.fake.reply, server.fake.delay = "The first answer.", 0.002
    send(page, "first question")
    wait_reply_done(page)
    server.fake.reply, server.fake.delay = LONG, 0.01
    set_setting(page, "#setting-max-tokens", 2000)  # ~20 s of streaming
    page.click("#toggle-settings")
    send(page, "now talk for a long time")
    page.wait_for_function(
        "() => { const m = document.getElementById('messages');"
        " return m.scrollHeight > 3 * m.clientHeight }"
    )
    # Following the bottom while the reader is there.
    assert page.evaluate(
        "() => { const m = document.getElementById('messages');"
        " return m.scrollHeight - m.scrollTop - m.clientHeight < 40 }"
    )
    page.evaluate(
        """() => {
        const box = document.getElementById('messages');
        box.scrollTop = 0;
        box.dispatchEvent(new Event('scroll'));
        const first = document.querySelector('.message.user .bubble');
        first.marked = true;  // the same node later, or the list was rebuilt
        const range = document.createRange();
        range.selectNodeContents(first);
        getSelection().removeAllRanges();
        getSelection().addRange(range);
    }"""
    )
    before = page.evaluate("document.querySelector('.message.streaming .bubble').innerText.length")
    page.wait_for_timeout(1200)
    assert page.locator(".message.streaming").count() == 1  # still streaming
    grown = page.evaluate("document.querySelector('.message.streaming .bubble').innerText.length")
    assert grown > before
    assert page.evaluate("document.getElementById('messages').scrollTop") < 5
    assert page.evaluate("getSelection().toString()") == "first question"
    assert page.evaluate("document.querySelector('.message.user .bubble').marked === true")
    assert page.is_visible("#jump")
    page.click("#jump")
    page.wait_for_timeout(600)
    assert page.evaluate(
        "() => { const m = document.getElementById('messages');"
        " return m.scrollHeight - m.scrollTop - m.clientHeight < 40 }"
    )
    assert not page.is_visible("#jump")
    page.click("#stop")
    wait_reply_done(page, 2)
    assert not page.errors
    page.context.close()


MARKDOWN = """Steps:

1. one

2. two

3. three

A list from three:

3. three
4. four

- outer
  - inner a
  - inner b
- outer two

  still outer two

| Name | Score |
|:-----|------:|
| Ada | 10 |

---

~~struck~~ and `inline`.

```python
def f(x):
    return x + 1
```
"""


def test_markdown_renders_as_commonmark_with_tables_and_highlighting(browser, server):
    page = open_page(browser, server)
    server.fake.reply, server.fake.delay = MARKDOWN, 0.001
    send(page, "markdown please")
    wait_reply_done(page)
    bubble = page.locator(".message.assistant .bubble")
    lists = bubble.locator("ol")
    assert lists.count() == 2
    assert lists.nth(0).locator("li").count() == 3  # not "1. 1. 1."
    assert lists.nth(1).get_attribute("start") == "3"  # not restarted at 1
    assert bubble.locator("ul ul li").count() == 2  # nested
    assert "still outer two" in bubble.locator(":scope > ul > li").nth(1).inner_text()
    assert bubble.locator("table th").all_inner_texts() == ["Name", "Score"]
    assert bubble.locator("td.align-right").inner_text() == "10"
    assert bubble.locator("hr").count() == 1
    assert bubble.locator("s").inner_text() == "struck"
    code = bubble.locator("pre code.language-python")
    assert code.locator("span.k").first.inner_text() == "def"  # a keyword token
    color = code.locator("span.k").first.evaluate("e => getComputedStyle(e).color")
    plain = code.evaluate("e => getComputedStyle(e).color")
    assert color != plain  # highlighted, not only marked up
    assert bubble.locator("pre .copy").count() == 1
    page.context.close()


HOSTILE = """<img src=x onerror="window.pwned = 1">
<script>window.pwned = 2</script>
[click me](javascript:window.pwned=3)
<svg onload="window.pwned = 4"></svg>
![tracker](https://evil.example/pixel.png)
<a href="https://evil.example" onclick="window.pwned = 5">a</a>
```html"><img src=x onerror="window.pwned=6">
<b>code</b>
```
| <img src=x onerror="window.pwned=7"> |
|---|
| x |
"""


def test_hostile_replies_never_become_markup_in_the_page(browser, server):
    page = open_page(browser, server)
    server.fake.reply, server.fake.delay = HOSTILE, 0.001
    send(page, "be evil")
    wait_reply_done(page)
    page.wait_for_timeout(300)
    assert page.evaluate("window.pwned") is None
    bubble = page.locator(".message.assistant .bubble")
    for tag in ("img", "script", "svg", "iframe"):
        assert bubble.locator(tag).count() == 0, tag
    hrefs = bubble.locator("a").evaluate_all("as => as.map(a => a.getAttribute('href'))")
    assert all(h.startswith("https://") for h in hrefs)
    assert not bubble.locator("[onclick], [onerror], [onload], [style]").count()
    assert "<b>code</b>" in bubble.locator("pre code").inner_text()
    assert 'onerror="window.pwned = 1"' in bubble.inner_text()  # shown as text
    page.context.close()


def test_three_digit_list_numbers_fit_in_the_bubble(browser, server):
    page = open_page(browser, server)
    server.fake.reply = "\n".join(f"{n}. item {n}" for n in range(98, 103))
    server.fake.delay = 0.001
    send(page, "count")
    wait_reply_done(page)
    fits = page.evaluate(
        """() => {
        const ol = document.querySelector('.message.assistant ol');
        const bubble = ol.closest('.bubble');
        const ctx = document.createElement('canvas').getContext('2d');
        ctx.font = getComputedStyle(ol).font;
        const marker = ctx.measureText('102. ').width;
        const pad = parseFloat(getComputedStyle(ol).paddingLeft);
        const left = ol.getBoundingClientRect().left - bubble.getBoundingClientRect().left;
        return { marker, pad, left, start: ol.getAttribute('start') };
    }"""
    )
    assert fits["start"] == "98"
    assert fits["pad"] >= fits["marker"], fits  # the marker is drawn inside the padding
    assert fits["left"] >= 0
    page.context.close()
