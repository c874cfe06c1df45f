"""The status page at the REST port's ``/``, in a real headless browser (Debian's chromium and
chromedriver, driven by selenium): while a client streams, the numbers it shows move and equal
``/v1/status``; a screenshot is saved with the test's output.

Skipped when chromium, chromedriver or selenium is missing, unless ``LOADER_REQUIRE_BROWSER=1``
(CI sets it after ``.ci/browser-prereqs.sh``), where that is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

BATCH = 16
REQUIRED = os.environ.get("LOADER_REQUIRE_BROWSER") == "1"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,1100")


def _browser_or_skip():
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip, dev extra)")
    if missing:
        why = f"the status page test needs {', '.join(missing)} (.ci/browser-prereqs.sh installs them)"
        if REQUIRED:
            pytest.fail(why + "; LOADER_REQUIRE_BROWSER=1 makes that a failure")
        pytest.skip(why)


@pytest.fixture
def browser():
    _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    profile = tempfile.mkdtemp(prefix="loader-chromium-")  # a fresh profile: no state from other runs
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    # explicit driver and browser: selenium does not look anything up on the network
    driver = webdriver.Chrome(service=DriverService(executable_path=shutil.which("chromedriver")), options=opts)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _status(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/status", timeout=10) as r:
        return json.loads(r.read())


def _until(fn, what: str, timeout: float = 60.0):
    """``fn()`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


PAGE_STATE = """
const p = window.statusPage, q = (s) => document.querySelector(s);
const field = (f) => { const e = q(`[data-field="${f}"]`); return e ? e.textContent : null; };
return {renders: p.renders, last: p.last, history: p.history, error: p.error || null,
        samples: field("totals.samples"), batches: field("totals.batches"), instance: field("instance"),
        live: field("workers.live"), clientRows: [...document.querySelectorAll("#clients tbody tr")].map(
            (tr) => [...tr.children].map((td) => td.textContent)),
        workerRows: document.querySelectorAll("#workers tbody tr").length,
        chartPoints: q("#chart-line").getAttribute("points").trim().split(/\\s+/).filter(Boolean).length};
"""


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _settled(driver, url, more_than: int):
    """The page state once /v1/status counts more than ``more_than`` samples and what the page
    shows equals /v1/status read just before and just after it (the stream is paused, so the
    service's counts stop once the batches asked for are sent)."""
    before = _status(url)["totals"]["samples"]
    page = driver.execute_script(PAGE_STATE)
    after = _status(url)
    if before <= more_than or page["last"] is None or not (
            before == after["totals"]["samples"] == _number(page["samples"])):
        return None
    return page, after


def test_status_page_follows_a_streaming_client(make_service, browser, tmp_path):
    from client.loader import RemoteLoader

    svc = make_service(workers=2)
    url = svc.http_url
    browser.get(url + "/?refresh=300")
    first = _until(lambda: (lambda s: s if s["renders"] >= 1 else None)(browser.execute_script(PAGE_STATE)),
                   "the first render")
    status = _status(url)
    assert first["error"] is None
    assert first["instance"] == status["instance"]
    assert _number(first["samples"]) == 0 and first["clientRows"] == [["none"]]
    assert first["workerRows"] == len(status["workers"]["list"])

    # a client whose every batch the test lets through, so the page can be compared at rest
    permits, errors, done = threading.Semaphore(0), [], threading.Event()
    taken = []

    def consume():
        try:
            with RemoteLoader(svc.endpoint, batch_size=BATCH, image_size=32, prefetch=2, timeout=60) as loader:
                it = iter(loader)
                while True:
                    if not permits.acquire(timeout=120):
                        raise TimeoutError("the test stopped releasing batches")
                    try:
                        images, _ = next(it)
                    except StopIteration:
                        return
                    taken.append(images.shape[0])
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    try:
        for _ in range(3):
            permits.release()
        _until(lambda: len(taken) == 3 or errors, "the client to take 3 batches")
        page1, status1 = _until(lambda: _settled(browser, url, 0), "the page to show /v1/status after 3 batches")
        n1 = status1["totals"]["samples"]
        assert n1 >= 3 * BATCH
        assert _number(page1["batches"]) == status1["totals"]["batches"]
        # the client's row: its samples as /v1/status has them, its position and dataset
        (client,) = status1["clients"]
        (row,) = page1["clientRows"]
        assert row[0] == client["client"] and row[2] == "demo"
        assert _number(row[-1]) == client["samples"]
        assert row[5] == f"{client['stream']['sent']}/{client['stream']['num_batches']}"
        assert row[6] == client["delivery"] == "data frames"
        assert client["slots"] == "stream" and row[-2] == f"stream {_fmt_bytes(client['slot_bytes'])}"

        for _ in range(6):
            permits.release()
        _until(lambda: len(taken) == 9 or errors, "the client to take 6 more batches")
        page2, status2 = _until(lambda: _settled(browser, url, n1), "the page to show more samples after 6 more batches")
        assert _number(page2["samples"]) == status2["totals"]["samples"] > n1  # the numbers moved
        assert page2["last"]["instance"] == status2["instance"]
        assert page2["renders"] > page1["renders"]
        assert page2["chartPoints"] >= 2 and max(v for _, v in page2["history"]) > 0  # the chart drew the rate
        browser.save_screenshot(str(tmp_path / "status-page.png"))
        out = os.environ.get("LOADER_TEST_OUTPUT")
        if out:  # CI keeps it with the run's output
            os.makedirs(out, exist_ok=True)
            shutil.copy(tmp_path / "status-page.png", os.path.join(out, "status-page.png"))
        assert (tmp_path / "status-page.png").stat().st_size > 10_000
    finally:
        for _ in range(10_000):  # let the epoch finish so the client closes cleanly
            permits.release()
        assert done.wait(120), "the client did not finish"
        t.join(10)
    assert not errors, errors
    assert sum(taken) == 240  # the whole demo epoch arrived (conftest's DEMO_SIZE)


def test_page_is_served_self_contained(service):
    """``/`` and its files come from the service, open (no token), with a policy that lets the
    browser load nothing from elsewhere; the files name no other host."""
    from loader_service.control.http_api import STATIC_DIR

    with urllib.request.urlopen(service.http_url + "/", timeout=10) as r:
        html = r.read().decode()
        assert r.headers["Content-Type"].startswith("text/html")
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]
    assert 'src="static/status.js"' in html and 'href="static/status.css"' in html
    for name in sorted(os.listdir(STATIC_DIR)):
        with urllib.request.urlopen(f"{service.http_url}/static/{name}", timeout=10) as r:
            body = r.read().decode()
        body = body.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace is a name, not a load
        assert "http://" not in body and "https://" not in body, f"{name} refers to another host"
        assert service.api_token not in body
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(service.http_url + "/static/../config.py", timeout=10)
    err.value.close()
    assert err.value.code == 404


def _fmt_bytes(b: float) -> str:
    """The page's fmtBytes."""
    units, i = ["B", "KiB", "MiB", "GiB", "TiB"], 0
    while b >= 1024 and i < len(units) - 1:
        b, i = b / 1024, i + 1
    return f"{b:,.{1 if i else 0}f} {units[i]}"
