"""Images from the ``image_url`` values of requests, loaded safely.

An image comes as a ``data:`` URL (base64 or percent-encoded), an ``http(s)://`` URL that the
server fetches only when its host is listed in ``--allowed-media-domains`` (none by default: no
server-side fetches), or a ``file://`` URL / absolute path that the server reads only under
``--allowed-local-media-path``. Every image is bounded before it costs much: bytes per image
(``MAX_IMAGE_BYTES``), fetch time (``--media-fetch-timeout``), pixels per image read from the
header before decoding (``MAX_IMAGE_PIXELS``, which also makes decompression bombs harmless),
and bytes and pixels per request (``MAX_REQUEST_BYTES``, ``MAX_REQUEST_PIXELS``). Fetching is
asynchronous and decoding runs on worker threads, so no image holds up the event loop. Each
refusal is a ``ParamError`` naming the request field, which the APIs turn into a 400.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence
from urllib.parse import unquote, unquote_to_bytes, urljoin, urlsplit

from PIL import Image, UnidentifiedImageError

from pagoda.errors import ParamError, check
from pagoda.multimodal.options import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MediaConfig

if TYPE_CHECKING:  # imported when a server fetches its first URL: one that fetches none never loads it
    import httpx

# Image types accepted (MIME type -> PIL's format name); nothing else is decoded.
IMAGE_MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/pjpeg": "JPEG",
                    "image/webp": "WEBP", "image/gif": "GIF", "image/bmp": "BMP", "image/x-ms-bmp": "BMP"}
IMAGE_FORMATS = tuple(sorted(set(IMAGE_MIME_TYPES.values())))
MAX_REDIRECTS = 5
# Images of one request fetched at once (a request of many URLs opens no more connections).
FETCHES_PER_REQUEST = 8
DECODE_WORKERS = 2


# ---- per-request budget ---------------------------------------------------------------------

@dataclass
class RequestBudget:
    """Bytes and pixels one request's images may take together (shared by its decoding threads)."""

    max_bytes: int
    max_pixels: int
    used_bytes: int = 0
    used_pixels: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_bytes(self, n: int, where: str, param: str) -> None:
        with self.lock:
            self.used_bytes += n
            over = self.used_bytes > self.max_bytes
        check(not over, param, f"{where}: the request's images together exceed {self.max_bytes} bytes")

    def take_pixels(self, n: int, where: str, param: str) -> None:
        with self.lock:
            self.used_pixels += n
            over = self.used_pixels > self.max_pixels
        check(not over, param, f"{where}: the request's images together exceed {self.max_pixels} pixels")


# ---- decoding -----------------------------------------------------------------------------------

def decode_image(data: bytes, where: str, param: str, max_pixels: int = MAX_IMAGE_PIXELS,
                 budget: RequestBudget | None = None) -> Image.Image:
    """An RGB image of ``data`` (PNG, JPEG, WebP, GIF or BMP; an animation's first frame). The
    size is read from the header and refused above ``max_pixels`` before anything is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ParamError(param, f"{where}: the image is too large ({_reason(exc)}); at most {max_pixels} "
                         "pixels") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ParamError(param, f"{where}: not a decodable image ({', '.join(IMAGE_FORMATS).lower()}): "
                         f"{_reason(exc)}") from None
    width, height = image.size
    check(width > 0 and height > 0, param, f"{where}: the image is empty ({width}x{height})")
    check(width * height <= max_pixels, param, f"{where}: the image is {width}x{height} = {width * height} pixels; "
          f"at most {max_pixels}")
    if budget is not None:
        budget.take_pixels(width * height, where, param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
            return to_rgb(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ParamError(param, f"{where}: the image is too large ({_reason(exc)}); at most {max_pixels} "
                         "pixels") from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
        raise ParamError(param, f"{where}: the image data is corrupt or truncated: {_reason(exc)}") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as RGB; transparent pixels over white (as they show on a page)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def data_url_bytes(url: str, where: str, param: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a ``data:`` URL of a supported image type."""
    header, comma, payload = url[len("data:"):].partition(",")
    check(bool(comma), param, f"{where}: a data URL needs a ',' before its data (data:image/png;base64,...)")
    options = [p.strip().lower() for p in header.split(";")]
    mime = options[0] or "text/plain"
    check(mime in IMAGE_MIME_TYPES, param, f"{where}: media type {mime[:80]!r} is not a supported image type "
          f"({', '.join(sorted(IMAGE_MIME_TYPES))})")
    if "base64" in options[1:]:
        compact = "".join(payload.split())  # line breaks some encoders add
        check(len(compact) // 4 * 3 <= max_bytes + 3, param, f"{where}: the image is larger than {max_bytes} bytes")
        try:
            data = base64.b64decode(compact, validate=True)
        except (binascii.Error, ValueError):
            raise ParamError(param, f"{where}: the data URL's base64 data is not valid base64") from None
    else:
        check(len(payload) <= 3 * max_bytes, param, f"{where}: the image is larger than {max_bytes} bytes")
        data = unquote_to_bytes(payload)
    check(len(data) <= max_bytes, param, f"{where}: the image is {len(data)} bytes; at most {max_bytes}")
    check(len(data) > 0, param, f"{where}: the data URL holds no data")
    return data


# ---- the loader -------------------------------------------------------------------------------

class ImageLoader:
    """Loads the images of requests within ``MediaConfig``'s rules. Used from one event loop:
    fetches are asynchronous (httpx) and decoding runs on ``DECODE_WORKERS`` threads."""

    def __init__(self, config: MediaConfig) -> None:
        self.config = config
        self._pool = ThreadPoolExecutor(DECODE_WORKERS, thread_name_prefix="pagoda-media")
        self._client: httpx.AsyncClient | None = None

    async def load_all(self, sources: Sequence[tuple[Any, str]], param: str) -> list[Image.Image]:
        """Images of ``(source, where)`` pairs, in order; the first failure cancels the others
        and is raised. A source is a URL (or path) string, or an image given in-process."""
        budget = RequestBudget(self.config.max_request_bytes, self.config.max_request_pixels)
        fetches = asyncio.Semaphore(FETCHES_PER_REQUEST)
        tasks = [asyncio.ensure_future(self.load(src, where, param, budget, fetches)) for src, where in sources]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
                elif not task.cancelled():
                    task.exception()  # a second failure is seen, not logged as never retrieved

    async def load(self, source: Any, where: str, param: str, budget: RequestBudget | None = None,
                   fetches: asyncio.Semaphore | None = None) -> Image.Image:
        """One image: a ``data:``, ``http(s)://`` or ``file://`` URL, an absolute path, or a
        PIL image (offline callers)."""
        if isinstance(source, Image.Image):
            size = source.size[0] * source.size[1]
            check(size <= self.config.max_image_pixels, param,
                  f"{where}: the image has {size} pixels; at most {self.config.max_image_pixels}")
            return await self._run(to_rgb, source)
        check(isinstance(source, str) and source != "", param, f"{where}: an image URL must be a non-empty string")
        scheme = source.split(":", 1)[0].lower() if ":" in source[:12] else ""
        if scheme == "data":
            return await self._run(self._decode_data_url, source, where, param, budget)
        if scheme in ("http", "https"):
            async with fetches or asyncio.Semaphore(1):
                data = await self._fetch(source, where, param, budget)
        elif scheme == "file" or source.startswith("/"):
            data = await self._run(self._read_local, source, where, param, budget)
        else:
            raise ParamError(param, f"{where}: an image URL must be a data: URL, an http(s):// URL or a file:// "
                             f"URL, got {source[:40]!r}")
        return await self._run(decode_image, data, where, param, self.config.max_image_pixels, budget)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _decode_data_url(self, url: str, where: str, param: str, budget: RequestBudget | None) -> Image.Image:
        data = data_url_bytes(url, where, param, self.config.max_image_bytes)
        if budget is not None:
            budget.take_bytes(len(data), where, param)
        return decode_image(data, where, param, self.config.max_image_pixels, budget)

    # ---- local files ------------------------------------------------------------------------
    def _read_local(self, source: str, where: str, param: str, budget: RequestBudget | None) -> bytes:
        """The bytes of a file under ``--allowed-local-media-path`` (symlinks resolved first)."""
        root = self.config.local_root
        check(root is not None, param, f"{where}: this server reads no local files (start it with "
              "--allowed-local-media-path DIR to allow files under DIR)")
        path = self._local_path(source, where, param)
        real = os.path.realpath(path)
        check(os.path.commonpath([real, root]) == root, param,
              f"{where}: {path[:200]!r} is not under the server's --allowed-local-media-path")
        check(os.path.isfile(real), param, f"{where}: {path[:200]!r} is not a readable file")
        max_bytes = self.config.max_image_bytes
        try:
            with open(real, "rb") as f:
                data = f.read(max_bytes + 1)
        except OSError as exc:
            raise ParamError(param, f"{where}: {path[:200]!r} cannot be read: {exc.strerror}") from None
        check(len(data) <= max_bytes, param, f"{where}: the file is larger than {max_bytes} bytes")
        if budget is not None:
            budget.take_bytes(len(data), where, param)
        return data

    @staticmethod
    def _local_path(source: str, where: str, param: str) -> str:
        if not source.lower().startswith("file:"):
            return source
        parts = urlsplit(source)
        check(parts.netloc in ("", "localhost"), param, f"{where}: a file:// URL must name a local file "
              f"(file:///path), not host {parts.netloc[:80]!r}")
        path = unquote(parts.path)
        check(path.startswith("/"), param, f"{where}: a file:// URL needs an absolute path")
        return path

    # ---- fetching ---------------------------------------------------------------------------
    def _check_host(self, url: str, where: str, param: str) -> None:
        allowed = self.config.allowed_domains
        check(bool(allowed), param, f"{where}: this server fetches no image URLs (start it with "
              "--allowed-media-domains to allow hosts); send the image as a data: URL")
        try:
            host = (urlsplit(url).hostname or "").lower().rstrip(".")
        except ValueError:
            host = ""
        check(host in allowed, param, f"{where}: host {host[:80]!r} is not in the server's --allowed-media-domains")

    def _http(self) -> httpx.AsyncClient:
        import httpx

        if self._client is None:
            # Redirects are followed by hand, so that each hop's host is checked.
            self._client = httpx.AsyncClient(follow_redirects=False, timeout=self.config.fetch_timeout)
        return self._client

    async def _fetch(self, url: str, where: str, param: str, budget: RequestBudget | None) -> bytes:
        """The body of ``url`` (2xx, an image content type), within the time and size limits."""
        import httpx

        timeout = self.config.fetch_timeout
        try:
            return await asyncio.wait_for(self._fetch_hops(url, where, param, budget), timeout)
        except asyncio.TimeoutError:
            raise ParamError(param, f"{where}: fetching the image took longer than {timeout:g} s "
                             "(the server's --media-fetch-timeout)") from None
        except httpx.HTTPError as exc:
            raise ParamError(param, f"{where}: the image could not be fetched: {type(exc).__name__}: "
                             f"{_reason(exc)}") from None

    async def _fetch_hops(self, url: str, where: str, param: str, budget: RequestBudget | None) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            self._check_host(url, where, param)
            async with self._http().stream("GET", url, headers={"Accept": "image/*"}) as response:
                if response.is_redirect:
                    url = urljoin(url, response.headers.get("location", ""))
                    continue
                check(response.status_code == 200, param,
                      f"{where}: fetching the image answered HTTP {response.status_code}")
                self._check_content_type(response, where, param)
                return await self._body(response, where, param, budget)
        raise ParamError(param, f"{where}: more than {MAX_REDIRECTS} redirects")

    @staticmethod
    def _check_content_type(response: httpx.Response, where: str, param: str) -> None:
        kind = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        # Servers that do not know the type say octet-stream; the decoder checks the bytes then.
        check(kind in IMAGE_MIME_TYPES or kind in ("", "application/octet-stream"), param,
              f"{where}: the URL's content type {kind[:80]!r} is not a supported image type")

    async def _body(self, response: httpx.Response, where: str, param: str, budget: RequestBudget | None) -> bytes:
        limit = self.config.max_image_bytes
        declared = response.headers.get("content-length", "")
        check(not declared.isdigit() or int(declared) <= limit, param,
              f"{where}: the image is {declared} bytes; at most {limit}")
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            check(len(data) <= limit, param, f"{where}: the image is larger than {limit} bytes")
            if budget is not None:
                budget.take_bytes(len(chunk), where, param)
        return bytes(data)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self._pool.shutdown(wait=False)


def load_images_sync(config: MediaConfig, sources: Sequence[tuple[Any, str]], param: str) -> list[Image.Image]:
    """``ImageLoader.load_all`` for synchronous callers (offline ``LLM.chat``): on a private event
    loop in its own thread, so it works whether or not the caller runs an event loop."""

    async def run() -> list[Image.Image]:
        loader = ImageLoader(config)
        try:
            return await loader.load_all(sources, param)
        finally:
            await loader.aclose()

    with ThreadPoolExecutor(1, thread_name_prefix="pagoda-media-sync") as pool:
        return pool.submit(asyncio.run, run()).result()
