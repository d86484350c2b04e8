"""Branches in a real Chromium: editing a message or regenerating a reply keeps the earlier
versions (‹ 1/2 ›), one message can be deleted, a whole one copied; they survive a reload.
(Continuing a reply cut at its length limit needs the real model: test_page_window.py.)"""

import pytest

from tests.e2e.page_util import fake_server, open_page, send, wait_reply_done


@pytest.fixture(scope="module")
def server(tokenizer):
    with fake_server(tokenizer) as s:
        yield s


def reply_text(page):
    return page.locator(".message.assistant .bubble").last.inner_text().strip()


def position(page, role):
    return page.locator(f".message.{role} .branches .position").last.inner_text()


def test_regenerate_and_edit_keep_earlier_versions(browser, server, tokenizer):
    fake = server.fake
    page = open_page(browser, server)
    fake.reply = "first answer"
    send(page, "Question one")
    wait_reply_done(page)
    assert page.locator(".branches").count() == 0  # one version: no selector
    fake.reply = "second answer"
    page.click(".message.assistant .regenerate")
    wait_reply_done(page)
    assert reply_text(page) == "second answer" and position(page, "assistant") == "2/2"
    page.click(".message.assistant .branches .prev")
    assert reply_text(page) == "first answer" and position(page, "assistant") == "1/2"
    page.click(".message.assistant .branches .next")
    assert reply_text(page) == "second answer"

    fake.reply = "answer to the edit"
    page.click(".message.user .edit")
    page.fill(".message.user textarea.edit", "Question one, edited")
    page.click(".message.user .save")
    wait_reply_done(page)
    assert position(page, "user") == "2/2"
    assert reply_text(page) == "answer to the edit"
    last = tokenizer.decode(list(fake.prompts.values())[-1])
    assert "Question one, edited" in last and "second answer" not in last
    page.click(".message.user .branches .prev")  # back to the first question...
    assert page.locator(".message.user .bubble").inner_text() == "Question one"
    assert reply_text(page) == "second answer"  # ...with the reply it had
    assert position(page, "assistant") == "2/2"

    # A follow-up goes on from the version shown, and all of it survives a reload.
    fake.reply = "follow-up answer"
    send(page, "And then?")
    wait_reply_done(page, 2)
    sent = tokenizer.decode(list(fake.prompts.values())[-1])
    assert "second answer" in sent and "edited" not in sent
    page.reload()
    page.wait_for_selector("#connection[data-state=open]")
    wait_reply_done(page, 2)
    assert page.locator(".message.user .bubble").first.inner_text() == "Question one"
    assert position(page, "user") == "1/2" and reply_text(page) == "follow-up answer"
    assert not page.errors
    page.context.close()


def test_delete_one_message_and_copy_a_whole_one(browser, server):
    fake = server.fake
    page = open_page(browser, server)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    fake.reply = "Some **bold** text\n\n```python\nx = 1\n```"
    send(page, "Something to copy")
    wait_reply_done(page)
    page.click(".message.assistant .copy-message")
    assert page.evaluate("navigator.clipboard.readText()") == fake.reply  # the Markdown
    page.click(".message.user .copy-message")
    assert page.evaluate("navigator.clipboard.readText()") == "Something to copy"

    page.click(".message.assistant .delete-message")
    assert page.locator(".message.assistant").count() == 0
    assert page.locator(".message.user").count() == 1
    fake.reply = "a new reply"
    send(page, "Second question")
    wait_reply_done(page)
    page.click(".message.user >> nth=0 >> .delete-message")  # the first question goes
    users = page.locator(".message.user .bubble").all_inner_texts()
    assert users == ["Second question"]
    page.reload()
    page.wait_for_selector("#connection[data-state=open]")
    assert page.locator(".message.user .bubble").all_inner_texts() == ["Second question"]
    assert reply_text(page) == "a new reply"
    page.context.close()
