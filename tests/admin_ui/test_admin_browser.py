"""End to end in headless Debian Chromium (Playwright) against the real server on 127.0.0.1 and a tiny
random model: sign in from the keyboard, upload a PEFT adapter made with peft (and a DoRA one the store
refuses, whose message shows next to the form), run completions through the API with the tenant's key,
and watch the usage table, the charts and the latency figures change; keys; delete; a second tenant sees
nothing of the first; the operator edits limits. Every page is screenshotted at a laptop and a phone width
and checked for sideways scrolling and unlabelled controls. The tests run in order and share one browser
session per tenant."""

from __future__ import annotations

import base64
import csv
import io
import re
import zipfile
from dataclasses import dataclass, field

import httpx
import pytest

from admin_browser import check_page, sign_in
from api_server import OPERATOR_KEY, make_tenant

NAME = "support-bot"


@dataclass
class Scenario:
    key: str  # the first tenant's admin key
    other_key: str  # the second tenant's
    page: object  # the first tenant's signed-in page
    requests: list[str] = field(default_factory=list)  # every URL the browser asked for
    tokens: dict[str, int] = field(default_factory=dict)


@pytest.fixture(scope="module")
def s(live, browser, screenshots):
    _, key = make_tenant(live, "acme")
    _, other = make_tenant(live, "globex")
    context = browser.new_context(viewport={"width": 1366, "height": 900}, accept_downloads=True)
    scenario = Scenario(key, other, context.new_page())
    context.on("request", lambda r: scenario.requests.append(r.url))
    yield scenario
    context.close()


def text(page, selector: str) -> str:
    return page.locator(selector).inner_text().strip()


def test_a_user_key_cannot_sign_in(live, browser, s, screenshots):
    with live.client(s.key) as c:
        user_key = c.post("/v1/keys", json={"role": "user"}).json()["api_key"]
    context = browser.new_context()
    page = context.new_page()
    sign_in(page, live.url, user_key)
    assert page.url.endswith("/admin/login")
    assert "cannot sign in" in text(page, "#login-error")
    assert not any(c["name"] == "loraplex_admin" for c in context.cookies())
    check_page(page, screenshots, "login-refused")
    context.close()


def test_sign_in_from_the_keyboard(live, s, screenshots):
    page = s.page
    page.goto(f"{live.url}/admin/adapters")
    assert "/admin/login" in page.url  # signed out: to the form, and back after
    check_page(page, screenshots, "login")
    sign_in(page, live.url, s.key)
    assert page.url.endswith("/admin/adapters")
    page.keyboard.press("Tab")  # the first stop is the skip link, which jumps to the content
    assert page.evaluate("document.activeElement.className") == "skip"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    cookie = next(c for c in page.context.cookies() if c["name"] == "loraplex_admin")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/admin"
    assert "No adapters yet" in text(page, "#adapter-count")


def test_a_refused_upload_shows_the_store_message(live, s, adapters, screenshots):
    page = s.page
    page.fill("#upload-name", "dora-bot")
    page.set_input_files("#upload-files", sorted(str(p) for p in adapters["dora"].iterdir()))
    page.click("#upload-submit")
    error = page.locator("#upload-error")
    error.wait_for(state="visible")
    assert "DoRA" in error.inner_text()
    assert page.url.split("#")[0].endswith("/admin/adapters")  # still on the form, the name kept
    assert page.input_value("#upload-name") == "dora-bot"
    check_page(page, screenshots, "adapters-upload-refused")


def test_upload_with_progress_opens_the_detail_page(live, s, adapters, screenshots):
    page = s.page
    # Watch the real upload: the bar appearing and the values it shows on each progress event (kept in
    # sessionStorage, which survives the page moving on to the new adapter).
    page.evaluate("""() => {
        const wrap = document.getElementById('upload-progress-wrap');
        const bar = document.getElementById('upload-progress');
        const note = (k, v) => {
            const seen = JSON.parse(sessionStorage.getItem('seen') || '{"visible": false, "values": []}');
            if (k === 'visible') seen.visible = seen.visible || v; else seen.values.push(v);
            sessionStorage.setItem('seen', JSON.stringify(seen));
        };
        new MutationObserver(() => note('visible', !wrap.hidden)).observe(wrap, {attributes: true});
        const send = XMLHttpRequest.prototype.send;
        XMLHttpRequest.prototype.send = function (body) {
            // Added after the page's own listener: reads what the page has just set.
            this.upload.addEventListener('progress', () => note('value', bar.value));
            return send.call(this, body);
        };
    }""")
    page.fill("#upload-name", NAME)
    page.set_input_files("#upload-files", sorted(str(p) for p in adapters["good"].iterdir()))
    page.click("#upload-submit")
    page.wait_for_url(f"**/admin/adapters/{NAME}?uploaded=1")
    seen = page.evaluate("JSON.parse(sessionStorage.getItem('seen'))")
    assert seen["visible"] and seen["values"] and seen["values"][-1] == 100, seen
    assert "Uploaded version 1" in text(page, "#uploaded")
    facts = text(page, "dl.facts")
    assert "Rank\n8" in facts or re.search(r"Rank\s+8", facts)
    assert "q_proj, v_proj, o_proj, down_proj" in facts or all(m in facts for m in ("q_proj", "down_proj"))
    check_page(page, screenshots, "adapter-detail")


def test_dropping_a_folders_files_adds_a_version(live, s, adapters):
    page = s.page
    page.goto(f"{live.url}/admin/adapters")
    files = [{"name": p.name, "b64": base64.b64encode(p.read_bytes()).decode()}
             for p in sorted(adapters["other"].iterdir())]
    page.evaluate("""(files) => {
        const dt = new DataTransfer();
        for (const f of files) {
            const bytes = Uint8Array.from(atob(f.b64), (c) => c.charCodeAt(0));
            dt.items.add(new File([bytes], f.name));
        }
        const zone = document.getElementById('drop-zone');
        zone.dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));
    }""", files)
    page.wait_for_function("() => document.querySelectorAll('#drop-list li').length >= 2")
    page.fill("#upload-name", NAME)
    page.click("#upload-submit")
    page.wait_for_url(f"**/admin/adapters/{NAME}?uploaded=2")
    assert page.locator("#versions-table tbody tr").count() == 2


def test_a_folder_can_be_chosen(live, s, adapters):
    page = s.page
    page.goto(f"{live.url}/admin/adapters")
    page.fill("#upload-name", "folder-bot")
    page.set_input_files("#upload-folder", str(adapters["good"]))  # the folder itself (webkitdirectory)
    page.click("#upload-submit")
    page.wait_for_url("**/admin/adapters/folder-bot?uploaded=1")


def test_one_archive_can_be_chosen(live, s, adapters, tmp_path):
    archive = tmp_path / "adapter.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for p in adapters["other"].iterdir():
            z.write(p, p.name)
    page = s.page
    page.goto(f"{live.url}/admin/adapters")
    page.fill("#upload-name", "zip-bot")
    page.set_input_files("#upload-files", str(archive))
    page.click("#upload-submit")
    page.wait_for_url("**/admin/adapters/zip-bot?uploaded=1")
    assert re.search(r"Rank\s+4", text(page, "dl.facts"))


def _flush(live) -> None:
    assert live.state.recorder.flush(30)


def test_traffic_updates_usage_charts_and_latency(live, s, screenshots):
    page = s.page
    page.goto(f"{live.url}/admin/usage")
    assert text(page, "#total-requests") == "0"
    assert page.get_attribute("#chart-requests svg", "data-points") == "0"
    page.goto(f"{live.url}/admin/latency")
    assert text(page, "#lat-ttft") == "—"

    prompt = completion = 0
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {s.key}"}, timeout=120) as api:
        for i in range(4):
            r = api.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3 + i, "temperature": 0,
                                                  "adapter_id": NAME, "ignore_eos": True})
            assert r.status_code == 200, r.text
            prompt += r.json()["usage"]["prompt_tokens"]
            completion += r.json()["usage"]["completion_tokens"]
        r = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                                   "ignore_eos": True})  # the base model
        assert r.status_code == 200
        prompt += r.json()["usage"]["prompt_tokens"]
        completion += r.json()["usage"]["completion_tokens"]
    s.tokens = {"prompt": prompt, "completion": completion}
    _flush(live)

    page.goto(f"{live.url}/admin/usage")
    assert text(page, "#total-requests") == "5"
    assert text(page, "#total-prompt") == f"{prompt:,}" and text(page, "#total-completion") == f"{completion:,}"
    assert page.get_attribute("#chart-requests svg", "data-max") == "5"
    assert int(page.get_attribute("#chart-tokens svg", "data-points")) >= 2  # tokens in and out
    assert page.locator("#chart-requests svg rect.bar").count() >= 1
    rows = {r.locator("th").inner_text(): r.locator("td").nth(1).inner_text()
            for r in page.locator("#usage-by-adapter tbody tr").all()}
    assert rows == {NAME: "4", "base": "1"}
    check_page(page, screenshots, "usage")

    # Filter by adapter, hourly: the bot's four requests only.
    page.fill("#f-adapter", NAME)
    page.select_option("#f-granularity", "hour")
    page.click("form.filters button[type=submit]")
    page.wait_for_load_state()
    assert "adapter=" + NAME in page.url and text(page, "#total-requests") == "4"
    with page.expect_download() as download:
        page.click("text=Download CSV")
    lines = list(csv.DictReader(io.StringIO(download.value.path().read_text())))
    assert {r["adapter"] for r in lines} == {NAME} and sum(int(r["requests"]) for r in lines) == 4

    page.goto(f"{live.url}/admin/latency")
    assert text(page, "#lat-requests") == "5"
    assert re.fullmatch(r"[\d.,]+ m?s / [\d.,]+ m?s / [\d.,]+ m?s", text(page, "#lat-ttft")), text(page, "#lat-ttft")
    assert re.fullmatch(r"[\d.,]+ m?s / [\d.,]+ m?s / [\d.,]+ m?s", text(page, "#lat-itl")), text(page, "#lat-itl")
    assert int(page.get_attribute("#chart-ttft svg", "data-points")) == 3  # p50, p95, p99 of one day
    assert page.locator("#chart-itl svg circle").count() == 3
    names = [r.locator("th").inner_text() for r in page.locator("#latency-adapters tbody tr").all()]
    assert sorted(names) == sorted(["base", NAME])
    check_page(page, screenshots, "latency")

    page.goto(f"{live.url}/admin/adapters")
    versions = {r.locator("td").first.inner_text(): r.locator("td").last.inner_text()
                for r in page.locator("#adapters-table tbody tr", has_text=NAME).all()}
    assert versions == {"1": "0", "2": "4"}  # requests in the last 24 h: the newest version served them
    check_page(page, screenshots, "adapters")


def test_keys_are_shown_once_and_revoked(live, s, screenshots):
    page = s.page
    page.goto(f"{live.url}/admin/keys")
    page.select_option("#key-role", "user")
    page.fill("#key-label", "ci-bot")
    page.click("text=Create key")
    secret = page.input_value("#new-key")
    assert secret.startswith("lpx_")
    check_page(page, screenshots, "keys-created")
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {secret}"}) as api:
        assert api.get("/v1/models").status_code == 200
        page.goto(f"{live.url}/admin/keys")
        assert secret not in page.content()  # shown once only
        row = page.locator("#keys-table tbody tr", has_text="ci-bot")
        assert row.locator("th").inner_text() == secret[:12] + "…"
        check_page(page, screenshots, "keys")
        row.locator("text=Revoke…").click()
        check_page(page, screenshots, "key-revoke")
        page.click("#confirm-revoke")
        page.wait_for_url("**/admin/keys?revoked=*")
        assert "revoked" in page.locator("#keys-table tbody tr", has_text="ci-bot").inner_text()
        assert api.get("/v1/models").status_code == 401


def test_delete_with_confirmation(live, s, screenshots):
    page = s.page
    page.goto(f"{live.url}/admin/adapters/folder-bot")
    page.click("text=Delete…")
    assert page.url.endswith("/admin/adapters/folder-bot/delete")
    check_page(page, screenshots, "adapter-delete")
    page.click("text=Cancel")
    assert page.url.endswith("/admin/adapters/folder-bot")  # nothing deleted
    page.click("text=Delete…")
    page.click("#confirm-delete")
    page.wait_for_url("**/admin/adapters?deleted=folder-bot")
    assert page.locator("#adapters-table", has_text="folder-bot").count() == 0
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {s.key}"}) as api:
        r = api.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "adapter_id": "folder-bot"})
        assert r.status_code == 404
    page.goto(f"{live.url}/admin/adapters/folder-bot")
    assert "no adapter named" in text(page, "#error-message")


def test_search_and_paging_through_many_adapters(live, s):
    """A thousand more adapter versions registered directly: the table pages through them 100 at a time."""
    from loraplex.adapter_store.schemas import AdapterCreate

    registry = live.state.registry
    tenant_id = registry.authenticate(s.key).tenant_id
    template = registry.resolve(tenant_id, NAME)
    registry.add_adapters([AdapterCreate(tenant_id=tenant_id, name=f"bulk-{i:04d}",
                                         base_model_fingerprint=template.base_model_fingerprint, rank=8, alpha=16.0,
                                         target_modules=template.target_modules, dtype=template.dtype,
                                         size_bytes=template.size_bytes, sha256=template.sha256,
                                         storage_key=template.storage_key) for i in range(1000)])
    page = s.page
    page.goto(f"{live.url}/admin/adapters")
    page.fill("#search-q", "BULK-")
    page.select_option("#search-size", "100")
    page.click("form.search button[type=submit]")
    page.wait_for_load_state()
    assert text(page, "#adapter-count").startswith("Showing 1–100 of 1,000")
    for _ in range(3):
        page.click("a[rel=next]")
        page.wait_for_load_state()
    assert text(page, "#adapter-count").startswith("Showing 301–400 of 1,000")
    assert page.locator("#adapters-table tbody th").first.inner_text() == "bulk-0300"
    page.click("a[rel=prev]")
    page.wait_for_load_state()
    assert page.locator("#adapters-table tbody th").first.inner_text() == "bulk-0200"
    page.fill("#search-q", "bulk-0999")
    page.click("form.search button[type=submit]")
    page.wait_for_load_state()
    assert [r.inner_text() for r in page.locator("#adapters-table tbody th").all()] == ["bulk-0999"]


def test_a_second_tenant_sees_none_of_it(live, browser, s, screenshots):
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    page = context.new_page()
    sign_in(page, live.url, s.other_key)
    assert page.url.endswith("/admin/adapters")
    assert "No adapters yet" in text(page, "#adapter-count")
    assert NAME not in page.content()
    page.goto(f"{live.url}/admin/adapters/{NAME}")
    assert "no adapter named" in text(page, "#error-message")
    check_page(page, screenshots, "not-found")
    page.goto(f"{live.url}/admin/usage")
    assert text(page, "#total-requests") == "0" and NAME not in page.content()
    page.goto(f"{live.url}/admin/latency?adapter={NAME}")
    assert text(page, "#lat-requests") == "0"
    context.close()


def test_the_operator_edits_limits_and_sees_usage(live, browser, s, screenshots):
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    page = context.new_page()
    sign_in(page, live.url, OPERATOR_KEY)
    assert page.url.endswith("/admin/tenants")
    row = page.locator("#tenants-table tbody tr", has_text="acme")
    cells = row.locator("td").all_inner_texts()
    assert cells[5] == "6"  # requests in the last 24 h: five served, one refused (the deleted adapter)
    assert cells[6] == f"{s.tokens['prompt']:,} / {s.tokens['completion']:,}"
    check_page(page, screenshots, "tenants")
    row.locator("a").click()
    page.fill("#t-ttft_target_ms", "abc")
    page.click("text=Save")
    assert "TTFT target (ms)" in text(page, "#tenant-error")
    check_page(page, screenshots, "tenant-edit")
    page.fill("#t-ttft_target_ms", "60000")
    page.fill("#t-requests_per_minute", "120")
    page.fill("#t-max_concurrent", "4")
    page.fill("#t-share", "2.5")
    page.click("text=Save")
    page.wait_for_url("**/admin/tenants?updated=acme")
    cells = page.locator("#tenants-table tbody tr", has_text="acme").locator("td").all_inner_texts()
    assert cells[:5] == ["60,000 ms", "120", "default", "4", "2.5"]
    tenant = live.state.registry.get_tenant_by_name("acme")
    assert (tenant.ttft_target_ms, tenant.requests_per_minute, tenant.max_concurrent, tenant.share) == \
        (60000, 120, 4, 2.5)
    # The next request is measured against the new target; the tenant's latency page shows the share.
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {s.key}"}, timeout=120) as api:
        r = api.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "adapter_id": NAME})
        assert r.status_code == 200, r.text
    _flush(live)
    s.page.goto(f"{live.url}/admin/latency")
    assert "60,000 ms" in text(s.page, "section.totals") and text(s.page, "#lat-share") == "100.0%"

    # A new tenant: its first admin key is shown once and signs in.
    page.fill("#tenant-name", "initech")
    page.click("text=Create tenant")
    key = page.input_value("#new-key")
    check_page(page, screenshots, "tenant-created")
    assert key.startswith("lpx_") and page.locator("#tenants-table", has_text="initech").count() == 1
    other = browser.new_context().new_page()
    sign_in(other, live.url, key)
    assert other.url.endswith("/admin/adapters") and "initech" in text(other, "header .who")
    other.context.close()
    context.close()


def test_sign_out(live, s):
    page = s.page
    page.goto(f"{live.url}/admin/usage")
    page.click("text=Sign out")
    page.wait_for_url("**/admin/login")
    page.goto(f"{live.url}/admin/keys")
    assert "/admin/login" in page.url


def test_nothing_was_fetched_from_elsewhere(live, s):
    """Everything the pages need (styles, scripts, charts) comes from the server itself."""
    assert s.requests and all(u.startswith(live.url + "/") or u.startswith("data:") for u in s.requests), \
        [u for u in s.requests if not u.startswith(live.url)]
