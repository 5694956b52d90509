"""Open the built site in headless Chromium, as a reader at 1280 px would (part of `make docs`).

Serves docs/_build/html on 127.0.0.1 (a free port) and drives one headless Chromium through the
DevTools protocol over a pipe (``--remote-debugging-pipe``: no port, no extra package):

1. **search**: ``search.html?q=hang_timeout`` must list the hangs guide and ``?q=is_main_process``
   its entry in the API reference (the search runs in the browser from the static index, so this
   checks the index and the JavaScript);
2. **nothing runs off the page**: every page of the site is laid out 1280 px wide and measured; a
   code block, table, image or line of text wider than the text column (hidden behind a scrollbar,
   or reaching past the column), or a page that scrolls sideways, fails the check, naming the page,
   the element and its first words (a probe page that overflows on purpose must be caught first);
3. **screenshots** of the key pages (``KEY_PAGES``: home, a guide, the API reference, the benchmarks,
   the support table) at 1280 x 1000 into ``docs/_build/screenshots/`` (``--full`` for whole pages):
   look at them after a change to the layout.

Chromium gets a fresh profile, and ``HOME``/``XDG_*`` pointing into a temporary directory, all
removed afterwards: the check writes nothing under your home directory.

    python docs/check_site.py [--html DIR] [--query WORD] [--chromium PATH] [--full] [--pages GLOB]
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import functools
import http.server
import json
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

DOCS = Path(__file__).resolve().parent
WIDTH, HEIGHT = 1280, 1000

#: screenshot name -> page (relative to the site root)
KEY_PAGES = {
    "home": "index.html",
    "guide-checkpoints": "guides/checkpoints.html",
    "api-reference": "reference/generated/api.html",
    "benchmarks": "status/benchmarks.html",
    "support": "status/support.html",
}

#: What "runs off the page" means, measured in the page (returns a list of findings): an element
#: of the main text column whose content is wider than its box (a code block or table scrolled
#: sideways hides the rest) or whose box reaches past the column's right edge, or a page wider than
#: the window. Elements inside a code block or a table are judged by that block or table.
MEASURE = r"""
(() => {
  const found = [];
  const root = document.documentElement;
  if (root.scrollWidth > root.clientWidth + 1)
    found.push({what: 'page', text: `the page scrolls sideways (${root.scrollWidth} px wide in a ${root.clientWidth} px window)`});
  const column = document.querySelector('article[role=main]') || document.querySelector('article') || document.body;
  // the theme lets headings and tables reach a few pixels into the column's padding: the edge is
  // that of the content box around the article (Furo's .content), not the article's own
  const right = (document.querySelector('.content') || column).getBoundingClientRect().right;
  const words = (el) => (el.innerText || el.alt || el.getAttribute('src') || '').trim().replace(/\s+/g, ' ').slice(0, 90);
  const judged = 'pre, .highlight, table, .table-wrapper, img, p, li, dt, dd, h1, h2, h3, h4, blockquote';
  for (const el of column.querySelectorAll(judged)) {
    if (el.parentElement && el.parentElement.closest('pre, table')) continue;
    const box = el.getBoundingClientRect();
    if (box.width === 0 || box.height === 0) continue;
    const style = getComputedStyle(el);
    const clips = style.overflowX !== 'visible';
    if (clips && el.scrollWidth > el.clientWidth + 1)
      found.push({what: el.tagName.toLowerCase() + (el.className ? '.' + String(el.className).split(' ')[0] : ''),
                  text: `${words(el)} -- ${el.scrollWidth - el.clientWidth} px hidden to the right`});
    else if (box.right > right + 1)
      found.push({what: el.tagName.toLowerCase(),
                  text: `${words(el)} -- reaches ${Math.round(box.right - right)} px past the text column`});
  }
  return found;
})()
"""


# ---- a minimal DevTools-protocol client over --remote-debugging-pipe ------------------------------
class Browser:
    """One headless Chromium driven through the DevTools protocol on file descriptors 3 and 4."""

    def __init__(self, binary: str, scratch: str) -> None:
        import fcntl

        pipes = [os.pipe(), os.pipe()]  # (to Chromium), (from Chromium)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for pair in pipes for fd in pair]  # clear of fds 3, 4
        for pair in pipes:
            for fd in pair:
                os.close(fd)
        to_chrome_r, self._to_chrome, self._from_chrome, from_chrome_w = high
        env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
        env.update(HOME=scratch, XDG_CONFIG_HOME=f"{scratch}/.config", XDG_CACHE_HOME=f"{scratch}/.cache",
                   XDG_DATA_HOME=f"{scratch}/.local/share")
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-extensions", "--disable-crash-reporter", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={scratch}/profile", "--remote-debugging-pipe", "about:blank"]
        self.log = os.path.join(scratch, "chromium.log")
        # the protocol's pipes become Chromium's fds 3 (commands) and 4 (replies); every other fd of
        # ours is close-on-exec
        self.pid = os.posix_spawn(binary, cmd, env, file_actions=[
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            (os.POSIX_SPAWN_OPEN, 2, self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
            (os.POSIX_SPAWN_DUP2, to_chrome_r, 3), (os.POSIX_SPAWN_DUP2, from_chrome_w, 4)])
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._replies: Dict[int, "queue.Queue[dict]"] = {}
        self._events: "queue.Queue[dict]" = queue.Queue()
        self._next = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=WIDTH, height=HEIGHT,
                  deviceScaleFactor=1, mobile=False)

    def _read(self) -> None:
        buffer = b""
        while True:
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "id" in message:
                    with self._lock:
                        box = self._replies.get(message["id"])
                    if box is not None:
                        box.put(message)
                else:
                    self._events.put(message)

    def call(self, method: str, session: bool = False, timeout: float = 60, **params: Any) -> Dict[str, Any]:
        with self._lock:
            self._next += 1
            ident = self._next
            box: "queue.Queue[dict]" = queue.Queue()
            self._replies[ident] = box
        message: Dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        try:
            reply = box.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"Chromium did not answer {method} within {timeout:.0f} s") from None
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def open(self, url: str, timeout: float = 60) -> None:
        """Load ``url`` and wait for its load event and its web fonts."""
        while not self._events.empty():
            self._events.get_nowait()
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self._events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{url} did not finish loading within {timeout:.0f} s") from None
            if event.get("method") == "Page.loadEventFired":
                break
        self.evaluate("document.fonts.ready.then(() => true)")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", session=True, expression=expression, awaitPromise=True,
                           returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"script failed: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def screenshot(self, path: Path, full: bool = False) -> None:
        params: Dict[str, Any] = {"format": "png"}
        if full:
            height = int(self.evaluate("document.documentElement.scrollHeight"))
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": WIDTH, "height": height, "scale": 1})
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", session=True, **params)["data"]))

    def close(self) -> str:
        """Close Chromium (killed if it does not exit in 10 s); return the end of its log."""
        try:
            self.call("Browser.close", timeout=10)
        except RuntimeError:
            pass
        deadline = time.monotonic() + 10
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, 9)
                os.waitpid(self.pid, 0)
                break
            time.sleep(0.1)
        os.close(self._to_chrome)
        with open(self.log, errors="replace") as f:
            return f.read()[-2000:]


# ---- the checks --------------------------------------------------------------------------------------
def find_chromium(explicit: Optional[str]) -> str:
    for name in ([explicit] if explicit else []) + ["chromium", "chromium-browser", "google-chrome", "chrome"]:
        path = shutil.which(name) if name else None
        if path:
            return path
    sys.exit("check_site: no Chromium found; install it (Debian: apt-get install -y chromium) "
             "or pass --chromium PATH")


#: A page that runs off on purpose: the overflow check must find it, or it measures nothing.
PROBE_PATH = "/__check_site_probe.html"
PROBE = ("<!doctype html><html><body><div class='content' style='width:600px'><article role='main'>"
         "<pre style='white-space:pre;overflow-x:auto'>" + "a_line_wider_than_the_column " * 20 + "</pre>"
         "<p style='width:900px'>a paragraph wider than the column</p></article></div></body></html>")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == PROBE_PATH:
            body = PROBE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()


def site_pages(html: Path) -> List[str]:
    """Every page of the built site a reader can open (relative paths)."""
    skip = {"genindex.html", "search.html", "py-modindex.html"}
    return sorted(p.relative_to(html).as_posix() for p in html.rglob("*.html")
                  if p.name not in skip and not p.relative_to(html).parts[0].startswith("_"))


#: word searched -> a page the results must include (the search runs in the browser, from the static index)
QUERIES = {"hang_timeout": "guides/hangs.html", "is_main_process": "reference/generated/api/setup.html"}


def check_search(browser: Browser, base: str, query: str, expected: str) -> Optional[str]:
    browser.open(f"{base}/search.html?q={query}")
    deadline = time.monotonic() + 20
    pages: List[str] = []
    while time.monotonic() < deadline:
        links = browser.evaluate("Array.from(document.querySelectorAll('ul.search li a')).map(a => a.getAttribute('href'))")
        pages = sorted({link.split('?')[0].split('#')[0] for link in links or []})
        if expected in pages:
            break
        time.sleep(0.2)
    if expected not in pages:
        return f"searching {query!r} did not list {expected} (found: {', '.join(pages[:8]) or 'nothing'})"
    print(f"check_site: search for {query!r} lists {expected} among {len(pages)} page(s)")
    return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html", default=str(DOCS / "_build" / "html"))
    parser.add_argument("--query", help="search only this word (default: each of QUERIES)")
    parser.add_argument("--chromium")
    parser.add_argument("--screenshots", default=str(DOCS / "_build" / "screenshots"))
    parser.add_argument("--full", action="store_true", help="screenshots of whole pages, not the first 1000 px")
    parser.add_argument("--pages", default="*", help="only measure the pages matching this glob")
    args = parser.parse_args(argv)

    html = Path(args.html)
    if not (html / "index.html").exists() or not (html / "search.html").exists():
        sys.exit(f"check_site: {html} has no index.html/search.html; build the site first (make docs-html)")
    binary = find_chromium(args.chromium)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(html)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    failures: List[str] = []
    started = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="anyaccel-chromium-")
    browser = None
    try:
        browser = Browser(binary, scratch)
        for query, expected in ({args.query: QUERIES.get(args.query, "index.html")} if args.query else QUERIES).items():
            problem = check_search(browser, base, query, expected)
            if problem:
                failures.append(problem)

        browser.open(base + PROBE_PATH)
        probe = browser.evaluate(MEASURE)
        if len(probe) != 2:
            failures.append(f"the overflow check found {len(probe)} of the 2 overflows of its probe page: {probe}")

        pages = [p for p in site_pages(html) if fnmatch.fnmatch(p, args.pages)]
        for page in pages:
            browser.open(f"{base}/{page}")
            for finding in browser.evaluate(MEASURE):
                failures.append(f"{page}: {finding['what']} runs off the page at {WIDTH} px: {finding['text']}")
        print(f"check_site: {len(pages)} pages measured at {WIDTH} px")

        shots = Path(args.screenshots)
        shots.mkdir(parents=True, exist_ok=True)
        for name, page in KEY_PAGES.items():
            if not (html / page).exists():
                failures.append(f"{page} (screenshot {name}) is not in the built site")
                continue
            browser.open(f"{base}/{page}")
            path = shots / f"{name}.png"
            browser.screenshot(path, full=args.full)
            if path.stat().st_size < 10_000:
                failures.append(f"the screenshot of {page} is nearly empty ({path.stat().st_size} bytes)")
        print(f"check_site: screenshots of {len(KEY_PAGES)} pages at {WIDTH} px in {shots} (look at them)")
    except RuntimeError as exc:
        stderr = browser.close() if browser is not None else ""
        browser = None
        failures.append(f"{exc}\n{stderr[-1500:]}")
    finally:
        if browser is not None:
            browser.close()
        server.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    for failure in failures:
        print(f"check_site: FAILED {failure}", file=sys.stderr)
    print(f"check_site: {'FAILED' if failures else 'ok'} in {time.monotonic() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
