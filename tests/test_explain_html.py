"""The HTML report opened in headless Chromium: self-contained, no console errors, a first
screen that is not blank. Chromium is Debian's ``chromium`` package (``.ci/run`` installs it);
outside CI the tests skip when it is absent."""

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from kvplan.explain import explain
from tests.explain_helpers import searched_plan

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and not os.environ.get("CI"):
    pytest.skip("headless Chromium is not installed (apt-get install chromium; .ci/run installs it)",
                allow_module_level=True)

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--enable-logging=stderr", "--v=0"]


def chromium(url: str, tmp_path, *extra) -> subprocess.CompletedProcess:
    assert CHROMIUM, "chromium must be installed in CI"
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *extra, url],
                          capture_output=True, text=True, timeout=120)


def console_problems(stderr: str) -> list[str]:
    """Lines where the page logged to the console or failed to load something."""
    return [l for l in stderr.splitlines() if ":CONSOLE" in l or "net::ERR" in l or "Failed to load" in l]


def screen_problems(png_path) -> list[str]:
    """Why a screenshot looks blank or wrong, or ``[]``."""
    import matplotlib.image

    img = matplotlib.image.imread(png_path)[..., :3]  # [H, W, 3] floats
    out = []
    colours = len(np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    if colours < 50:
        out.append(f"only {colours} distinct colours")
    title = img[: img.shape[0] // 10].mean(axis=2)
    if (title < 0.3).mean() < 0.5:
        out.append("the title area is not dark")
    if (img[img.shape[0] // 4:].mean(axis=2) < 0.5).mean() < 0.05:
        out.append("nothing drawn below the title")
    return out


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    d = tmp_path_factory.mktemp("html")
    html = d / "report.html"
    explain(searched_plan(d), html=html, importance=True)
    return html


def test_html_is_self_contained(page):
    text = page.read_text(encoding="utf-8")
    refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']|url\(([^)]*)\)""", text)
    assert refs and all((a or b).startswith("data:") for a, b in refs), refs
    assert "<script" not in text and "http://" not in text and "https://" not in text
    assert text.count("data:image/png;base64,") == 4  # allocation, bpv_context, pareto, importance
    for needle in ("Provenance", "produced_by", "test (held-out)", "honest bpv"):
        assert needle in text, needle


def test_html_renders_without_console_errors(page, tmp_path):
    r = chromium(page.as_uri(), tmp_path, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    assert console_problems(r.stderr) == []
    assert "<h1>kvplan explain:" in r.stdout and r.stdout.count("<img") == 4
    # the check itself sees a page that logs an error
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><script>console.error("boom")</script></body></html>')
    assert console_problems(chromium(bad.as_uri(), tmp_path, "--dump-dom").stderr)


def test_first_screen_screenshot(page, tmp_path):
    shot = tmp_path / "first.png"
    r = chromium(page.as_uri(), tmp_path, f"--screenshot={shot}", "--window-size=1280,800")
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    assert screen_problems(shot) == []
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    shot2 = tmp_path / "blank.png"
    chromium(blank.as_uri(), tmp_path, f"--screenshot={shot2}", "--window-size=1280,800")
    assert len(screen_problems(shot2)) == 3  # the check fails a blank page
