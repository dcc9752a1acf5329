"""Headless Chromium (Debian's chromium + chromium-driver) driven by selenium, for the Prefect UI tests.

`browser_missing()` says why a test cannot run here (and how to install what is missing); `open_resume_form`
and `submit_answer` answer a paused run's approval form in the Prefect 3.9 UI (its V1 pages, which serve
``/runs/flow-run/<id>``); `artifact_pictures` reads an artifact page of either UI (V2 is under ``/v2``).
Selectors were read off that UI: the enum field is a native ``<select>`` inside
prefect-design's ``p-select`` (next to an empty placeholder ``<select>``), text fields are ``<textarea>``s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
from urllib3.exceptions import ReadTimeoutError

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL = "apt-get install -y chromium chromium-driver (Debian), and selenium (pip, in the dev extra)"
#: Without the background-networking flags Chromium's own connections are refused on a closed network. Without
#: WebGL (--disable-3d-apis) the run page's graph stays blank, and its software-rendered canvas no longer spins a
#: renderer at full CPU (seen stalling webdriver calls past selenium's 120 s on a 2-core machine). Without a zygote
#: (--no-zygote, allowed with --no-sandbox): two zygote processes were once seen spinning at full CPU on both cores,
#: unkillable (SIGKILL pending), holding the rest of the suite at a crawl.
CHROME_ARGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
    "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-3d-apis", "--no-zygote",
)  # fmt: skip
WINDOW = (1400, 1100)
WAIT_S = 60  # a click takes seconds on a loaded 2-core machine
WATCHDOG_S = 240  # one browser session's whole life: past it, the browser is killed (BrowserStuck)


def browser_missing() -> str | None:
    """None when headless Chromium can be driven here, else what is missing and how to install it."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if importlib.util.find_spec("selenium") is None:
        missing.append("selenium")
    return f"no {', '.join(missing)}: {INSTALL}" if missing else None


@contextmanager
def chromium(width: int = WINDOW[0], height: int = WINDOW[1]) -> Iterator[Any]:
    """A headless Chromium with a fresh profile and a `width` × `height` window, quit and removed at the end."""
    from selenium import webdriver  # noqa: PLC0415 - optional: the test is skipped without it
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (*CHROME_ARGS, f"--window-size={width},{height}"):
        options.add_argument(arg)
    profile = tempfile.mkdtemp(prefix="lf-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    service = Service(CHROMEDRIVER)
    driver = webdriver.Chrome(service=service, options=options)  # no Selenium Manager download
    driver.set_page_load_timeout(WAIT_S)
    watchdog = threading.Timer(WATCHDOG_S, _kill_tree, args=(service.process.pid,))
    watchdog.daemon = True
    watchdog.start()
    try:
        yield driver
    except ReadTimeoutError as exc:  # a webdriver call unanswered for selenium's 120 s: the renderer is stuck
        _kill_tree(service.process.pid)
        raise BrowserStuck(f"headless Chromium did not answer a webdriver call; killed: {exc}") from exc
    except Exception as exc:
        if not watchdog.is_alive():
            raise BrowserStuck(f"headless Chromium killed after {WATCHDOG_S} s (a renderer spinning)") from exc
        raise
    finally:
        watchdog.cancel()
        with contextlib.suppress(Exception):
            driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class BrowserStuck(RuntimeError):
    """The browser did not finish within `WATCHDOG_S`: killed (seen twice on this machine: a renderer at full CPU
    for over ten minutes, no webdriver call returning)."""


def _kill_tree(pid: int) -> None:
    """SIGKILL chromedriver and every process below it (the browser and its renderers)."""
    with contextlib.suppress(psutil.Error):
        parent = psutil.Process(pid)
        for proc in [*parent.children(recursive=True), parent]:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def _by() -> Any:
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    return By


def _field(label: str, tail: str) -> tuple[str, str]:
    """A form field by its label ("Decision", "Note (Optional)"): the exact class token, since the outer
    ``schema-form-property-object`` containers contain the same text and would match every field."""
    return (
        _by().XPATH,
        "//div[contains(@class,'p-modal__body')]"
        "//div[contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')]"
        f"[.//span[contains(@class,'schema-form-property__label')][normalize-space()='{label}' "
        f"or starts-with(normalize-space(),'{label} (')]]{tail}",
    )


def _wait(driver: Any) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException  # noqa: PLC0415
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    return WebDriverWait(driver, WAIT_S, ignored_exceptions=(StaleElementReferenceException,))


def open_resume_form(driver: Any, ui_url: str, run_id: str, screenshot: Path | None = None) -> str:
    """Open the run's page, press Resume, wait for the form; returns the preview text shown above it."""
    from selenium.webdriver.support import expected_conditions as ec  # noqa: PLC0415

    by, wait = _by(), _wait(driver)
    driver.get(f"{ui_url.rstrip('/')}/runs/flow-run/{run_id}")
    resume = (by.XPATH, "//div[contains(@class,'page-heading__trailing')]//button[normalize-space()='Resume']")
    wait.until(ec.element_to_be_clickable(resume)).click()
    preview = wait.until(
        ec.visibility_of_element_located((by.CSS_SELECTOR, ".p-modal__body article.markdown-renderer"))
    )
    wait.until(ec.presence_of_element_located(_choice()))  # the form renders once the input schema is fetched
    if screenshot is not None:
        driver.save_screenshot(str(screenshot))
    return str(preview.text)


def _choice() -> tuple[str, str]:
    return _field("Decision", "//select[not(contains(@class,'p-native-select__control--placeholder'))]")


def submit_answer(driver: Any, choice: str | None, note: str = "", by: str = "") -> None:
    """Pick `choice` (None: leave it empty), fill note and by, press Submit; wait for the UI's verdict
    (the "Flow run resumed" toast, or, without a choice, the form's "required" error)."""
    from selenium.webdriver.support import expected_conditions as ec  # noqa: PLC0415
    from selenium.webdriver.support.ui import Select  # noqa: PLC0415

    xpath, wait = _by().XPATH, _wait(driver)
    if choice is not None:
        Select(wait.until(ec.presence_of_element_located(_choice()))).select_by_value(choice)
        wait.until(lambda d: Select(d.find_element(*_choice())).first_selected_option.get_attribute("value") == choice)
    for label, value in (("Note", note), ("Decided by", by)):
        if value:
            area = wait.until(ec.element_to_be_clickable(_field(label, "//textarea")))
            area.clear()
            area.send_keys(value)
            wait.until(
                lambda d, lb=label, v=value: d.find_element(*_field(lb, "//textarea")).get_property("value") == v
            )
    submit = (xpath, "//div[contains(@class,'p-modal__footer')]//button[normalize-space()='Submit']")
    wait.until(ec.element_to_be_clickable(submit)).click()
    if choice is None:
        error = "//div[contains(@class,'p-modal__body')]//*[normalize-space()=\"'choice' is a required property\"]"
        wait.until(ec.visibility_of_element_located((xpath, error)))
        return
    toast = "//div[contains(@class,'p-toast-container')]//*[normalize-space()='Flow run resumed']"
    wait.until(ec.visibility_of_element_located((xpath, toast)))


#: What `artifact_pictures` reads off the page: every embedded picture (its natural and shown width), what runs
#: past the window's right edge or its box (a table cut or scrolled sideways), and the page's text.
_PICTURES_JS = """
const images = [...document.querySelectorAll('img[src^="data:image/"]')].map(img => ({
  alt: img.alt, natural: img.naturalWidth, shown: img.getBoundingClientRect().width, complete: img.complete}));
const limit = document.documentElement.clientWidth;
const overflow = [];  // tag and text of each element past the right edge
for (const el of document.querySelectorAll('table, img, pre, p, li, h2, h3')) {
  const right = el.getBoundingClientRect().right;
  const box = el.parentElement;
  const cut = box && box.scrollWidth > box.clientWidth + 1 && getComputedStyle(box).overflowX !== 'visible';
  if (right > limit + 1 || (el.tagName === 'TABLE' && cut)) overflow.push(el.tagName + ': ' + el.innerText.slice(0, 9));
}
return {images, overflow, text: document.body.innerText};
"""


def open_run_artifact(driver: Any, base_url: str, run_id: str, key: str, screenshot: Path | None = None) -> str:
    """Open the run's Artifacts tab (`base_url`: either UI's root), wait for the artifact `key` to be listed, and
    follow its link as a person would; returns the artifact page's URL."""
    from selenium.webdriver.support import expected_conditions as ec  # noqa: PLC0415

    driver.get(f"{base_url.rstrip('/')}/runs/flow-run/{run_id}")
    tab = (_by().XPATH, "//*[(self::li or self::button or @role='tab') and normalize-space()='Artifacts']")  # V1, V2
    _wait(driver).until(ec.element_to_be_clickable(tab)).click()
    link = (_by().XPATH, f"//a[contains(@href,'/artifacts/artifact/')][contains(normalize-space(), '{key}')]")
    try:
        found = _wait(driver).until(lambda d: d.find_elements(*link))
    except Exception:
        if screenshot is not None:
            screenshot.with_suffix(".html").write_text(driver.page_source)
        raise
    if screenshot is not None:
        driver.save_screenshot(str(screenshot))
    href = str(found[0].get_attribute("href"))
    driver.get(href)
    return href


def artifact_pictures(driver: Any, url: str | None, expected: int, screenshot: Path | None = None) -> dict[str, Any]:
    """Open an artifact page (either UI; None: the page already open), wait until `expected` embedded pictures are
    there and loaded; returns `_PICTURES_JS`'s findings. Saves a screenshot of the whole page when asked."""
    if url is not None:
        driver.get(url)
    script = "return [...document.querySelectorAll('img[src^=\"data:image/\"]')].filter(i => i.complete).length"
    _wait(driver).until(lambda d: d.execute_script(script) >= expected)
    found = driver.execute_script(_PICTURES_JS)
    if screenshot is not None:
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(driver.get_window_size()["width"], min(max(height + 120, 800), 4000))
        driver.save_screenshot(str(screenshot))
    return found


#: The V2 UI (React, under ``/v2``): a paused run's Resume is an item of the page heading's "Open menu"; its dialog
#: shows the preview above a form whose enum field is a combobox button ("Select <EnumTitle>") opening a listbox,
#: and whose text fields are ``<textarea>``s named by their ``<label for=...>``. A refused answer shows a toast.
_V2_DIALOG = "//div[@role='dialog']"


def open_resume_form_v2(driver: Any, ui_url: str, run_id: str, screenshot: Path | None = None) -> str:
    """The V2 UI: open the run's page, choose Resume in its menu, wait for the form; returns the dialog's text."""
    from selenium.webdriver.support import expected_conditions as ec  # noqa: PLC0415

    xpath, wait = _by().XPATH, _wait(driver)
    driver.get(f"{ui_url.rstrip('/')}/v2/runs/flow-run/{run_id}")
    menu = (xpath, "(//button[@aria-haspopup='menu'][normalize-space()='Open menu'])[1]")
    wait.until(ec.element_to_be_clickable(menu)).click()
    wait.until(ec.element_to_be_clickable((xpath, "//*[@role='menuitem'][normalize-space()='Resume']"))).click()
    wait.until(ec.presence_of_element_located(_v2_choice()))  # the form renders once the input schema is fetched
    dialog = wait.until(ec.visibility_of_element_located((xpath, _V2_DIALOG)))
    if screenshot is not None:
        driver.save_screenshot(str(screenshot))
    return str(dialog.text)


def _v2_choice() -> tuple[str, str]:
    return _by().XPATH, f"{_V2_DIALOG}//button[@aria-haspopup='listbox'][starts-with(@aria-label,'Select ')]"


def _v2_textarea(driver: Any, label: str) -> Any:
    found = driver.find_element(_by().XPATH, f"{_V2_DIALOG}//label[starts-with(normalize-space(),'{label}')]")
    return driver.find_element(_by().ID, found.get_attribute("for"))


def submit_answer_v2(driver: Any, choice: str | None, note: str = "", by: str = "") -> None:
    """The V2 UI: pick `choice` (None: leave it empty), fill note and by, press Resume; wait for the verdict (the
    dialog closes, or, without a choice, the "'choice' is a required property" toast)."""
    from selenium.webdriver.support import expected_conditions as ec  # noqa: PLC0415

    xpath, wait = _by().XPATH, _wait(driver)
    if choice is not None:
        wait.until(ec.element_to_be_clickable(_v2_choice())).click()
        wait.until(ec.element_to_be_clickable((xpath, f"//*[@role='option'][normalize-space()='{choice}']"))).click()
        wait.until(lambda d: d.find_element(*_v2_choice()).text.strip() == choice)
    for label, value in (("Note", note), ("Decided by", by)):
        if value:
            area = _v2_textarea(driver, label)
            area.clear()
            area.send_keys(value)
            wait.until(lambda d, lb=label, v=value: _v2_textarea(d, lb).get_property("value") == v)
    submit = (xpath, f"{_V2_DIALOG}//div[@data-slot='dialog-footer']//button[normalize-space()='Resume']")
    wait.until(ec.element_to_be_clickable(submit)).click()
    if choice is None:
        toast = "//*[contains(normalize-space(), \"'choice' is a required property\")]"
        wait.until(ec.visibility_of_element_located((xpath, toast)))
        return
    wait.until(ec.invisibility_of_element_located((xpath, _V2_DIALOG)))
