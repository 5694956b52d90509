"""Open the built site in headless Chromium (part of `make docs`).

Serves docs/_build/html on 127.0.0.1 (a free port), then with Chromium:

1. loads ``search.html?q=hang_timeout`` and requires at least one result linking to a page of the site
   (the search runs in the browser from the static index, so this checks the index and the JavaScript);
2. writes a screenshot of the home page to docs/_build/screenshot-home.png (look at it).

    python docs/check_site.py [--html DIR] [--query WORD] [--chromium PATH]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

DOCS = Path(__file__).resolve().parent


def find_chromium(explicit: str | None) -> str:
    for name in ([explicit] if explicit else []) + ["chromium", "chromium-browser", "google-chrome", "chrome"]:
        path = shutil.which(name) if name else None
        if path:
            return path
    sys.exit("check_site: no Chromium found; install it (Debian: apt-get install -y chromium) "
             "or pass --chromium PATH")


def chromium(binary: str, profile: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html", default=str(DOCS / "_build" / "html"))
    parser.add_argument("--query", default="hang_timeout")
    parser.add_argument("--chromium")
    parser.add_argument("--screenshot", default=str(DOCS / "_build" / "screenshot-home.png"))
    args = parser.parse_args(argv)

    html = Path(args.html)
    if not (html / "index.html").exists() or not (html / "search.html").exists():
        sys.exit(f"check_site: {html} has no index.html/search.html; build the site first (make docs-html)")
    binary = find_chromium(args.chromium)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(html)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    failures = []
    try:
        with tempfile.TemporaryDirectory(prefix="anyaccel-chromium-") as profile:
            proc = chromium(binary, profile, "--virtual-time-budget=20000", "--dump-dom",
                            f"{base}/search.html?q={args.query}")
            dom = proc.stdout
            results = re.findall(r'<ul[^>]*class="search"[^>]*>(.*?)</ul>', dom, flags=re.S)
            links = re.findall(r'<a href="([^"]+\.html[^"]*)"', results[0]) if results else []
            if proc.returncode != 0 or not links:
                failures.append(f"searching {args.query!r} found nothing (chromium exit {proc.returncode}); "
                                f"page text: {re.sub(r'<[^>]+>', ' ', dom)[-800:]!r} {proc.stderr[-800:]}")
            else:
                pages = sorted({link.split('?')[0].split('#')[0] for link in links})
                print(f"check_site: search for {args.query!r} found {len(pages)} page(s): {', '.join(pages[:8])}")

        with tempfile.TemporaryDirectory(prefix="anyaccel-chromium-") as profile:  # fresh: no search highlight
            shot = Path(args.screenshot)
            shot.parent.mkdir(parents=True, exist_ok=True)
            shot.unlink(missing_ok=True)
            proc = chromium(binary, profile, "--window-size=1280,1000", "--hide-scrollbars",
                            "--virtual-time-budget=10000", f"--screenshot={shot}", f"{base}/index.html")
            if not shot.exists() or shot.stat().st_size < 10_000:
                failures.append(f"no screenshot of the home page (chromium exit {proc.returncode}): {proc.stderr[-800:]}")
            else:
                print(f"check_site: screenshot of the home page: {shot} ({shot.stat().st_size // 1024} KiB)")
    finally:
        server.shutdown()
    for failure in failures:
        print(f"check_site: FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
