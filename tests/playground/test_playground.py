"""The playground page in a real headless Chromium (Debian's `chromium`, driven by Playwright's Python
package), against a real `csd serve` with an API key.

Skips only where chromium or playwright is missing on a developer machine; with CI set, that is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.decoding.drafter_registry import DRAFTERS
from tests.api.conftest import REPO_ROOT, Server, start_server, wait_until

API_KEY = "sk-playground-test-key"
PROVENANCES = {"accepted", "rescued", "recovered", "bonus", "plain"}
# Text that repeats itself, so the n-gram drafter finds its continuations in the prompt.
REPEATING = (
    "red apple, green pear, yellow banana, purple grape, orange orange.\n"
    "red apple, green pear, yellow banana, purple grape, orange orange.\n"
    "red apple, green pear, yellow banana, purple grape, orange orange.\n"
    "red apple, green"
)
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # the model keeps counting: long, steady generations
OUTPUT = REPO_ROOT / "test-output"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(
            f"{reason}; CI must run the browser tests (apt-get install chromium; pip install playwright)"
        )
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        _missing("the chromium browser is not installed")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _missing("the playwright Python package is not installed")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, chromium_path: str) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("playground-server"),
        "--api-key", API_KEY, "--max-tokens-cap", "512", "--default-max-tokens", "32",
        api_key=API_KEY,
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(chromium_path: str):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Page:
    """A fresh browser tab on the playground, with the console errors it logged."""

    def __init__(self, browser, server: Server) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.page = self.context.new_page()
        self.page.set_default_timeout(60_000)
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.requests: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(server.url + "/")

    def set_key(self, key: str) -> None:
        self.page.fill("#api-key", key)
        self.page.dispatch_event("#api-key", "change")

    def configure(self, **fields: str) -> None:
        for name, value in fields.items():
            selector = "#" + name.replace("_", "-")
            if self.page.eval_on_selector(selector, "e => e.tagName") == "SELECT":
                self.page.select_option(selector, value)
            else:
                self.page.fill(selector, value)

    def run(self) -> None:
        self.page.click("#run")
        self.page.wait_for_function("document.querySelector('#status').textContent !== 'Ready.'")

    def wait_finished(self) -> str:
        self.page.wait_for_function("!document.body.classList.contains('running')", timeout=90_000)
        return self.page.text_content("#status") or ""

    def figure(self, name: str, pane: int = 0) -> str:
        return self.page.locator(".pane").nth(pane).locator(f'[data-fig="{name}"]').text_content() or ""

    def token_classes(self, pane: int = 0) -> list[str]:
        return (
            self.page.locator(".pane")
            .nth(pane)
            .locator(".stream .tok")
            .evaluate_all("spans => spans.map(s => s.className.replace('tok ', ''))")
        )

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser, server: Server) -> Iterator[Page]:
    tab = Page(browser, server)
    yield tab
    tab.close()


def _percent(text: str) -> float:
    match = re.fullmatch(r"([\d.]+) %", text)
    assert match, text
    return float(match.group(1)) / 100


def test_page_loads_with_its_own_files_only(page: Page, server: Server) -> None:
    page.page.wait_for_load_state("networkidle")
    assert page.page.title() == "csd-serve playground"
    assert page.errors == []
    assert all(url.startswith((server.url, "data:")) for url in page.requests), (
        page.requests
    )  # no CDN, no network
    # The form starts from the server's settings; every input has a label.
    assert page.page.input_value("#method") == "csd"
    assert page.page.input_value("#max-tokens") == "32"
    unlabelled = page.page.eval_on_selector_all(
        "input, select, textarea",
        "els => els.filter(e => !document.querySelector(`label[for='${e.id}']`)).map(e => e.id)",
    )
    assert unlabelled == []
    assert "requires a key" in (page.page.text_content("#key-hint") or "")
    # The page is public; the API behind it is not.
    assert httpx.get(f"{server.url}/v1/ocm/top", timeout=30).status_code == 401


def test_drafter_choices_are_the_registry_s(page: Page) -> None:
    """The form lists the registry's drafters (from GET /v1/drafters, once a key is entered), in its order,
    the ones this server lacks disabled with their reason; nothing in the page's files lists them."""
    # before the key, only the server's default (the list needs the key on this server); a wrong key keeps it
    # so, with the reason on hover
    assert page.page.eval_on_selector_all("#drafter option", "os => os.map(o => o.value)") == ["combined"]
    page.set_key("sk-wrong")
    page.page.wait_for_function("document.querySelector('#drafter').title !== ''")
    assert page.page.get_attribute("#drafter", "title") == (
        "Could not load the drafters: HTTP 401: the API key is not valid"
    )
    assert page.page.eval_on_selector_all("#drafter option", "os => os.map(o => o.value)") == ["combined"]
    # the OCM panel asked with the same key: once it has its 401 too, the browser has logged both
    page.page.wait_for_function("document.querySelector('#ocm-updated').textContent.startsWith('Could not')")
    page.errors.clear()  # the 401s it was meant to get
    page.set_key(API_KEY)
    page.page.wait_for_function(f"document.querySelectorAll('#drafter option').length === {len(DRAFTERS)}")
    options = page.page.eval_on_selector_all(
        "#drafter option", "os => os.map(o => [o.value, o.textContent, o.disabled, o.title])"
    )
    assert [o[0] for o in options] == [e.name for e in DRAFTERS]
    for (value, text, disabled, title), entry in zip(options, DRAFTERS, strict=True):
        assert text == f"{value} ({entry.description})"
        # this server has the embedded head and no draft model
        assert disabled == (entry.needs == "draft_model"), value
        assert title == (entry.hint if disabled else ""), value
    assert page.page.input_value("#drafter") == "combined"  # still the server's default
    assert page.page.get_attribute("#drafter", "title") == ""
    assert page.errors == []


def test_key_is_kept_for_the_session_only(page: Page) -> None:
    page.set_key(API_KEY)
    page.page.reload()
    assert page.page.input_value("#api-key") == API_KEY
    assert page.page.evaluate("localStorage.length") == 0
    assert page.page.evaluate("Object.keys(sessionStorage)") == ["csd-playground-api-key"]


def test_run_streams_coloured_tokens_and_figures(page: Page, server: Server) -> None:
    page.set_key(API_KEY)
    # lambda 0 and a loose tau let the OCM rescue a pattern the second time it is seen.
    page.configure(prompt=REPEATING, method="csd", drafter="ngram", k="6", tau="0.0001", max_tokens="40")
    page.configure(**{"lambda": "0"})
    page.run()
    page.page.wait_for_selector(".pane .stream .tok")
    assert page.wait_finished() == "Done.", page.page.text_content("#error")
    assert page.page.is_hidden("#error")

    classes = page.token_classes()
    assert classes and set(classes) <= PROVENANCES, classes
    assert set(classes) - {"plain"}, "the n-gram drafter on repeated text must get some tokens kept"
    # The figures agree with the tokens shown and with the server's statistics.
    assert int(page.figure("tokens")) == len(classes)
    assert float(page.figure("tps")) > 0
    assert 0 < _percent(page.figure("acceptance")) <= 1
    assert 0 <= _percent(page.figure("rescue")) <= _percent(page.figure("acceptance"))
    assert float(page.figure("tpf")) >= 1
    for title in page.page.locator(".stream .tok.rescued").evaluate_all("s => s.map(x => x.title)"):
        assert title.startswith("rescued: the target would have said"), title
    assert page.errors == []

    # The OCM panel shows what the endpoint says (the run rejected draft tokens, so there are patterns).
    def endpoint() -> list[dict]:
        data = httpx.get(f"{server.url}/v1/ocm/top?n=10", headers=server.headers, timeout=30).json()["data"]
        return [p for ns in data for p in ns["patterns"]]

    assert wait_until(lambda: endpoint(), timeout=10)
    page.page.wait_for_selector(".ocm tr.pattern")
    assert wait_until(lambda: page.page.locator(".ocm tr.pattern").count() == len(endpoint()), timeout=10)
    first = page.page.locator(".ocm tr.pattern").first.locator("td").all_text_contents()
    assert int(first[2]) == endpoint()[0]["count"]


def test_stop_stops_the_generation_on_the_server(page: Page, server: Server) -> None:
    page.set_key(API_KEY)
    page.configure(prompt=COUNTING, method="sd", max_tokens="500")
    before = server.metrics().value("vllm:generation_tokens_total")
    page.run()
    page.page.wait_for_function("document.querySelectorAll('.pane .stream .tok').length >= 4")
    # The figures move while the tokens stream, before any final statistics.
    page.page.wait_for_function("Number(document.querySelector('[data-fig=tokens]').textContent) >= 4")
    assert float(page.figure("tps")) > 0 and float(page.figure("tpf")) >= 1
    assert page.page.is_enabled("#stop")  # still running
    page.page.click("#stop")
    assert page.wait_finished() == "Stopped."
    assert page.page.is_hidden("#error")
    assert wait_until(lambda: server.metrics().value("vllm:num_requests_running") == 0, timeout=10)
    generated = server.metrics().value("vllm:generation_tokens_total") - before
    time.sleep(1.0)
    assert server.metrics().value("vllm:generation_tokens_total") - before == generated  # it stays stopped
    assert 4 <= generated < 500
    assert page.errors == []


def test_api_errors_are_shown(page: Page) -> None:
    page.set_key("sk-wrong")
    page.configure(max_tokens="8")
    page.run()
    assert page.wait_finished() == "Failed."
    assert page.page.is_visible("#error")
    assert page.page.text_content("#error") == "HTTP 401: the API key is not valid"

    # A 400 carries OpenAI's message and the field it is about (the form's own limit lifted, so the
    # request reaches the server).
    page.set_key(API_KEY)
    page.page.eval_on_selector("#max-tokens", "e => e.removeAttribute('max')")
    page.configure(max_tokens="100000")
    page.run()
    assert page.wait_finished() == "Failed."
    error = page.page.text_content("#error") or ""
    assert error.startswith("HTTP 400: ") and "(param: max_tokens)" in error, error


def test_side_by_side_runs_sd_and_csd(page: Page) -> None:
    page.set_key(API_KEY)
    page.configure(prompt=REPEATING, max_tokens="24", tau="0.0001")
    page.configure(**{"lambda": "0"})  # so that csd may rescue, and the screenshot shows it
    page.page.check("#side-by-side")
    page.run()
    assert page.wait_finished() == "Done.", page.page.text_content("#error")
    assert page.page.locator(".pane .pane-title").all_text_contents() == ["sd", "csd"]
    for pane in (0, 1):
        classes = page.token_classes(pane)
        assert classes and set(classes) <= PROVENANCES
        assert int(page.figure("tokens", pane)) == len(classes)
        assert float(page.figure("tps", pane)) > 0
    assert "rescued" not in page.token_classes(0)  # strict SD never rescues
    page.page.hover(".pane .stream .tok >> nth=0")
    OUTPUT.mkdir(exist_ok=True)
    page.page.screenshot(path=str(OUTPUT / "playground.png"), full_page=True)
    assert (OUTPUT / "playground.png").stat().st_size > 10_000
    assert page.errors == []
