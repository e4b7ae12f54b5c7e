"""The tracker's dashboard in a real headless browser (Debian's chromium driven by Playwright).

Loads ``GET /`` of a running test swarm, checks there are no console errors, that the model
and its nodes are shown, then kills a node and waits for the page (no reload) to show the
gap. A screenshot of each state is saved in the test's tmp dir (the path is printed).
Playwright's own browser download does not work offline: ``.ci/run`` installs Debian's
chromium, and this test only ever launches ``/usr/bin/chromium``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from swarm_harness import covered, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHROMIUM = Path(os.environ.get("MESHNET_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
MODEL = "meshnet-tiny/llama"
HEARTBEAT_S = 0.5


@pytest.fixture
def browser_page(tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            yield page
        finally:
            browser.close()


def test_dashboard_shows_models_nodes_and_a_gap_live(
    tiny_snapshot, swarm_factory, browser_page, tmp_path
):
    tiny_snapshot("llama")
    swarm = swarm_factory(heartbeat_s=HEARTBEAT_S)
    tracker = swarm.tracker("--model-id", MODEL, "--shard-start", "0", "--shard-end", "3",
                            "--quantization", "float32").wait_healthy()  # fmt: skip
    middle = swarm.node(tracker, MODEL, 3, 5, "--quantization", "float32").wait_healthy()
    tail = swarm.node(tracker, MODEL, 5, 6, "--quantization", "float32").wait_healthy()
    wait_for(lambda: covered(tracker, MODEL), timeout=30)

    page = browser_page
    problems: list[str] = []
    page.on("console", lambda msg: msg.type == "error" and problems.append(msg.text))
    page.on("pageerror", lambda exc: problems.append(f"uncaught: {exc}"))
    page.on("requestfailed", lambda req: problems.append(f"request failed: {req.url}"))
    page.goto(f"{tracker.url}/?interval=0.25", wait_until="load")

    model = page.locator(f'.model[data-model="{MODEL}"]')
    model.wait_for(timeout=10_000)
    page.wait_for_function(
        "() => document.querySelectorAll('#nodes tbody tr').length === 3", timeout=10_000
    )
    assert model.get_attribute("data-covered") == "true"
    assert model.locator(".layer").count() == 6
    assert model.locator(".layer.c0").count() == 0
    assert "covered by 3 serving nodes" in model.locator(".model-state").inner_text()
    rows = {
        row.get_attribute("data-node-id"): row.inner_text()
        for row in page.locator("#nodes tbody tr").all()
    }
    assert "tracker-node" in rows and "[0, 3)" in rows["tracker-node"]
    ranges = sorted(text.split("\t")[2] for text in rows.values())
    assert ranges == ["[0, 3)", "[3, 5)", "[5, 6)"]
    assert all("serving" in text and "float32" in text for text in rows.values())
    assert "live" in page.locator("#status").inner_text()
    shot = tmp_path / "dashboard-covered.png"
    page.screenshot(path=str(shot), full_page=True)

    tail.kill()  # SIGKILL: only missed heartbeats tell the tracker
    page.wait_for_selector(f'.model[data-model="{MODEL}"][data-covered="false"]', timeout=15_000)
    gap_cells = model.locator(".layer.c0")
    assert gap_cells.count() == 1
    assert gap_cells.first.get_attribute("data-layer") == "5"
    assert "gap: [5, 6)" in model.locator(".model-state").inner_text()
    page.wait_for_function(
        "() => document.querySelectorAll('#nodes tbody tr').length === 2", timeout=10_000
    )
    assert middle.popen.poll() is None
    gap_shot = tmp_path / "dashboard-gap.png"
    page.screenshot(path=str(gap_shot), full_page=True)
    artifacts = os.environ.get("MESHNET_TEST_ARTIFACTS")
    if artifacts:  # CI or a person collecting the screenshots
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        for path in (shot, gap_shot):
            shutil.copy(path, Path(artifacts) / path.name)
    print(f"dashboard screenshots: {shot} {gap_shot}")
    assert not problems, problems
