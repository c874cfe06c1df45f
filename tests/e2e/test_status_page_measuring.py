"""The status page's first frame says "measuring…" for every rate (the throughput card, each
worker's busy %) instead of zeros: a rate needs two snapshots (issue 40: the first frame
showed 0 img/s and 0% busy). From the second snapshot on, the numbers. In a real headless
browser, as tests/e2e/test_status_page.py (skipped the same way without one)."""

from __future__ import annotations

from tests.e2e.test_status_page import _status, _until, browser  # noqa: F401  (browser: the fixture)

FRAME = """
const p = window.statusPage;
return {renders: p.renders, uptime: p.last ? p.last.uptime_s : null,
        throughput: document.querySelector('[data-field="throughput.samples_per_s"]').textContent,
        busy: [...document.querySelectorAll("#workers tbody tr")].map((tr) => tr.children[4].textContent)};
"""


def test_rates_say_measuring_until_two_snapshots(make_service, browser):  # noqa: F811
    svc = make_service(workers=2)
    url = svc.http_url
    _until(lambda: len(_status(url)["workers"]["list"]) == 2, "both workers listed")
    browser.get(url + "/?refresh=600000")  # one render now, the next only when the test asks
    first = _until(lambda: (lambda f: f if f["renders"] == 1 else None)(browser.execute_script(FRAME)),
                   "the first render")
    assert first["throughput"] == "measuring…"
    assert first["busy"] and all(b == "measuring…" for b in first["busy"]), first

    # a second snapshot, later on the service's clock: rates now, from the difference
    _until(lambda: _status(url)["uptime_s"] > first["uptime"], "the service's clock to move")
    browser.execute_script("refresh();")
    second = _until(lambda: (lambda f: f if f["renders"] == 2 else None)(browser.execute_script(FRAME)),
                    "the second render")
    assert second["throughput"] != "measuring…" and float(second["throughput"].replace(",", "")) >= 0
    assert second["busy"] and all(b.endswith("%") for b in second["busy"]), second
