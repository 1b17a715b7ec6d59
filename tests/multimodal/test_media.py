"""Loading request images (pagoda.multimodal.media): data URLs of every accepted type, local
files under the allowed directory only, http(s) URLs from allowed hosts only (a loopback server
started here), and each bad input refused with a ``ParamError`` naming the request field and
the problem, before it costs much (bytes, pixels, time)."""
from __future__ import annotations

import asyncio
import base64
import io
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from PIL import Image

from media_server import HOLD_LIMIT_S, MediaServer
from pagoda.config import EngineArgs
from pagoda.errors import ParamError
from pagoda.entrypoints.openai.server import serve_parser
from pagoda.multimodal.media import ImageLoader, decode_image, load_images_sync
from pagoda.multimodal.options import DEFAULT_LIMIT_PER_PROMPT, MediaConfig

PARAM = "messages"
RED, BLUE = (200, 30, 40), (20, 40, 220)


def encode(image: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png(size: tuple[int, int] = (12, 8), color: tuple[int, int, int] = RED) -> bytes:
    return encode(Image.new("RGB", size, color), "PNG")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def load(config: MediaConfig, *sources: Any) -> list[Image.Image]:
    """Load ``sources`` with a fresh loader on a private event loop."""
    async def run() -> list[Image.Image]:
        loader = ImageLoader(config)
        try:
            return await loader.load_all([(s, f"{PARAM}[0].content[{i}]") for i, s in enumerate(sources)], PARAM)
        finally:
            await loader.aclose()

    return asyncio.run(run())


def refused(config: MediaConfig, source: Any, needle: str) -> ParamError:
    with pytest.raises(ParamError) as err:
        load(config, source)
    assert err.value.param == PARAM
    assert needle in str(err.value), str(err.value)
    assert f"{PARAM}[0].content[0]" in str(err.value)  # says which part
    return err.value


# ---- data URLs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                      ("GIF", "image/gif"), ("BMP", "image/bmp")])
def test_data_urls_of_each_type_decode_to_rgb(fmt: str, mime: str) -> None:
    source = Image.new("RGB", (16, 10), RED)
    [image] = load(MediaConfig(), data_url(encode(source, fmt), mime))
    assert image.mode == "RGB" and image.size == (16, 10)
    pixel = image.getpixel((8, 5))
    assert all(abs(a - b) <= 12 for a, b in zip(pixel, RED)), pixel  # JPEG / WebP are lossy


def test_transparency_becomes_white_and_order_is_kept() -> None:
    clear = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    images = load(MediaConfig(), data_url(png(color=BLUE)), data_url(encode(clear, "PNG")),
                  "data:image/png," + "".join(f"%{b:02X}" for b in png(color=RED)))  # percent-encoded
    assert [im.getpixel((0, 0)) for im in images] == [BLUE, (255, 255, 255), RED]


@pytest.mark.parametrize("url,needle", [
    ("data:text/plain;base64,aGVsbG8=", "not a supported image type"),
    ("data:image/svg+xml;base64,PHN2Zy8+", "not a supported image type"),
    ("data:image/png;base64,!!!notbase64!!!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG but not really").decode(), "not a decodable image"),
    ("data:image/png;base64,", "holds no data"),
    ("data:image/png;base64", "needs a ','"),
    ("ftp://example.com/x.png", "must be a data: URL"),
    ("", "non-empty"),
])
def test_bad_data_urls_are_refused(url: str, needle: str) -> None:
    refused(MediaConfig(), url, needle)


def test_a_format_outside_the_list_is_refused_whatever_the_mime_says() -> None:
    tiff = encode(Image.new("RGB", (4, 4), RED), "TIFF")
    refused(MediaConfig(), data_url(tiff, "image/png"), "not a decodable image")


def test_truncated_image_is_refused() -> None:
    data = encode(Image.new("RGB", (64, 64), RED), "PNG", compress_level=0)
    refused(MediaConfig(), data_url(data[: len(data) // 2]), "corrupt or truncated")


def test_decompression_bomb_is_refused_from_its_header() -> None:
    # 12000 x 12000 one-bit pixels compress to a few KB: 144 M pixels from a tiny request.
    bomb = encode(Image.new("1", (12000, 12000), 0), "PNG")
    assert len(bomb) < 200_000
    error = refused(MediaConfig(), data_url(bomb), "pixels")
    assert "144000000 pixels" in str(error)
    medium = encode(Image.new("1", (7000, 6000), 0), "PNG")  # under PIL's own limit, over pagoda's
    assert "7000x6000" in str(refused(MediaConfig(), data_url(medium), "at most 36000000"))
    # A configured limit below the image's size refuses it too; PIL's own bomb check is caught.
    with pytest.raises(ParamError, match="pixels"):
        decode_image(png((50, 50)), "x", PARAM, max_pixels=2499)
    old = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = 1000  # PIL raises its own DecompressionBombError above 2x this
    try:
        with pytest.raises(ParamError, match="pixels"):
            decode_image(png((60, 60)), "x", PARAM, max_pixels=10**9)
    finally:
        Image.MAX_IMAGE_PIXELS = old


def test_size_limits_per_image_and_per_request() -> None:
    big = png((64, 64))
    refused(MediaConfig(max_image_bytes=len(big) - 1), data_url(big), "bytes")
    two = MediaConfig(max_request_bytes=len(big) + 10)
    with pytest.raises(ParamError, match="together exceed"):
        load(two, data_url(big), data_url(big))
    with pytest.raises(ParamError, match="together exceed"):
        load(MediaConfig(max_request_pixels=64 * 64 + 1), data_url(big), data_url(big))
    assert len(load(two, data_url(big))) == 1


def test_in_process_images_are_taken_as_rgb() -> None:
    [image] = load(MediaConfig(), Image.new("L", (3, 3), 7))
    assert image.mode == "RGB" and image.getpixel((1, 1)) == (7, 7, 7)


def test_sync_loading_works_inside_a_running_event_loop() -> None:
    async def caller() -> list[Image.Image]:
        return load_images_sync(MediaConfig(), [(data_url(png()), "m")], PARAM)  # offline LLM.chat in a notebook

    assert asyncio.run(caller())[0].getpixel((0, 0)) == RED


# ---- local files --------------------------------------------------------------------------------

@pytest.fixture()
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "red.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png(color=BLUE))
    os.symlink(tmp_path / "secret.png", root / "link.png")  # points outside the root
    os.symlink(root / "red.png", root / "inside.png")
    return root


def test_local_files_only_under_the_allowed_directory(media_dir: Path) -> None:
    config = MediaConfig.from_flags(None, str(media_dir), None)
    images = load(config, f"file://{media_dir}/red.png", str(media_dir / "red.png"), f"file://{media_dir}/inside.png",
                  f"file://localhost{media_dir}/red%2Epng")
    assert [im.getpixel((0, 0)) for im in images] == [RED] * 4
    outside = "is not under the server's --allowed-local-media-path"
    refused(config, f"file://{media_dir}/../secret.png", outside)
    refused(config, str(media_dir / ".." / "secret.png"), outside)
    refused(config, f"file://{media_dir}/link.png", outside)  # a symlink is resolved first
    refused(config, "file:///etc/passwd", outside)
    refused(config, f"file://{media_dir}/absent.png", "not a readable file")
    refused(config, f"file://{media_dir}", "not a readable file")
    refused(config, f"file://elsewhere{media_dir}/red.png", "must name a local file")
    refused(MediaConfig(), f"file://{media_dir}/red.png", "reads no local files")


# ---- http(s) URLs -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def web() -> Iterator[MediaServer]:
    server = MediaServer()
    image = png(color=BLUE)
    big = encode(Image.frombytes("RGB", (100, 100), os.urandom(30000)), "PNG")  # noise: ~30 KB

    def slow(handler: Any) -> None:
        server.release.wait(HOLD_LIMIT_S)
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.send_header("Content-Length", str(len(image)))
        handler.end_headers()
        handler.wfile.write(image)

    def undeclared_big(handler: Any) -> None:  # no Content-Length: the body is counted as it arrives
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.end_headers()
        handler.wfile.write(big)
        handler.wfile.flush()
        handler.close_connection = True

    server.routes.update({
        "/blue.png": (200, {"Content-Type": "image/png"}, image),
        "/octet": (200, {"Content-Type": "application/octet-stream"}, image),
        "/big.png": (200, {"Content-Type": "image/png"}, big),
        "/undeclared-big": (200, {}, undeclared_big),
        "/page.html": (200, {"Content-Type": "text/html"}, b"<html></html>"),
        "/slow.png": (200, {}, slow),
        "/to-same-host": (302, {"Location": "/blue.png"}, b""),
        "/loop": (302, {"Location": "/loop"}, b""),
    })
    server.routes["/to-other-host"] = (302, {"Location": server.url("/other-host.png", host="localhost")}, b"")
    server.routes["/other-host.png"] = server.routes["/blue.png"]
    yield server
    server.close()


def test_allowed_hosts_are_fetched_and_redirects_followed(web: MediaServer) -> None:
    config = MediaConfig.from_flags(["127.0.0.1"], None, None)
    images = load(config, web.url("/blue.png"), web.url("/octet"), web.url("/to-same-host"))
    assert [im.getpixel((0, 0)) for im in images] == [BLUE] * 3


def test_no_fetch_unless_the_host_is_allowed(web: MediaServer) -> None:
    before = len(web.requests)
    refused(MediaConfig(), web.url("/blue.png"), "fetches no image URLs")  # the default: no fetches at all
    refused(MediaConfig.from_flags(["example.com"], None, None), web.url("/blue.png"),
            "host '127.0.0.1' is not in the server's --allowed-media-domains")
    assert len(web.requests) == before  # refused before any connection


def test_redirect_to_a_host_not_allowed_is_not_followed(web: MediaServer) -> None:
    config = MediaConfig.from_flags(["127.0.0.1"], None, None)
    refused(config, web.url("/to-other-host"), "host 'localhost' is not in")
    assert web.hits("/to-other-host") >= 1 and web.hits("/other-host.png") == 0
    refused(config, web.url("/loop"), "redirects")


def test_fetch_limits(web: MediaServer) -> None:
    allowed = MediaConfig.from_flags(["127.0.0.1"], None, None)
    small = MediaConfig(**{**allowed.__dict__, "max_image_bytes": 1000})
    refused(small, web.url("/big.png"), "at most 1000")  # declared Content-Length
    refused(small, web.url("/undeclared-big"), "larger than 1000 bytes")  # counted while streaming
    refused(allowed, web.url("/page.html"), "content type 'text/html'")
    refused(allowed, web.url("/missing.png"), "HTTP 404")
    closed = MediaServer()
    url = closed.url("/x.png")
    closed.close()
    refused(allowed, url, "could not be fetched")


def test_slow_fetch_times_out_without_holding_up_the_event_loop(web: MediaServer) -> None:
    config = MediaConfig.from_flags(["127.0.0.1"], None, None, 0.5)
    web.release.clear()

    async def run() -> tuple[list[str], BaseException | None]:
        loader = ImageLoader(config)
        order: list[str] = []
        fetch = asyncio.ensure_future(loader.load(web.url("/slow.png"), "m", PARAM))
        # While the fetch waits, the same loop (and loader) serves other work: a data URL loads.
        other = await loader.load(data_url(png()), "m", PARAM)
        order.append(f"other {other.size}")
        try:
            await fetch
            error = None
        except ParamError as exc:
            error = exc
        order.append("fetch ended")
        await loader.aclose()
        return order, error

    start = time.monotonic()
    order, error = asyncio.run(run())
    web.release.set()
    assert order == ["other (12, 8)", "fetch ended"]
    assert isinstance(error, ParamError) and "--media-fetch-timeout" in str(error) and "0.5 s" in str(error)
    assert time.monotonic() - start < HOLD_LIMIT_S  # ended by the timeout, not by the server


# ---- flags --------------------------------------------------------------------------------------

def test_media_flags_parse_as_vllm_names_them(tmp_path: Path) -> None:
    ns = serve_parser(raise_errors=True).parse_args([
        "--allowed-media-domains", "upload.wikimedia.org", "--allowed-local-media-path", str(tmp_path),
        "--allowed-media-domains", "Example.COM",  # repeated (as Ray Serve's args give a list): added
        "--limit-mm-per-prompt", '{"image": 2}', "--media-fetch-timeout", "2.5"])
    args = EngineArgs.from_namespace(ns)
    config = MediaConfig.from_flags(args.allowed_media_domains, args.allowed_local_media_path,
                                    args.limit_mm_per_prompt, args.media_fetch_timeout)
    assert config.allowed_domains == {"upload.wikimedia.org", "example.com"}
    assert config.local_root == os.path.realpath(tmp_path) and config.image_limit == 2 and config.fetch_timeout == 2.5
    default = EngineArgs.from_namespace(serve_parser().parse_args([]))
    plain = MediaConfig.from_flags(default.allowed_media_domains, default.allowed_local_media_path,
                                   default.limit_mm_per_prompt, default.media_fetch_timeout)
    assert plain.allowed_domains == frozenset() and plain.local_root is None
    assert plain.image_limit == DEFAULT_LIMIT_PER_PROMPT == 999


@pytest.mark.parametrize("flags,needle", [
    ({"limit_mm_per_prompt": "{image: 2}"}, "JSON"),
    ({"limit_mm_per_prompt": '{"image": -1}'}, "non-negative"),
    ({"limit_mm_per_prompt": '{"image": true}'}, "non-negative"),
    ({"limit_mm_per_prompt": '{"smell": 1}'}, "unknown modality"),
    ({"limit_mm_per_prompt": "[1]"}, "JSON object"),
    ({"allowed_media_domains": ["http://example.com"]}, "not a host name"),
    ({"allowed_media_domains": ["example.com:8080"]}, "not a host name"),
    ({"allowed_local_media_path": "/no/such/dir"}, "not a directory"),
    ({"media_fetch_timeout": 0}, "positive"),
])
def test_bad_media_flags_are_refused(flags: dict, needle: str) -> None:
    values = {"allowed_media_domains": None, "allowed_local_media_path": None, "limit_mm_per_prompt": None,
              "media_fetch_timeout": 5.0, **flags}
    with pytest.raises(ValueError, match=needle):
        MediaConfig.from_flags(**values)


def test_engine_config_carries_the_media_config(llama_dir: Path, tmp_path: Path) -> None:
    from pagoda.config import EngineConfig

    config = EngineConfig.from_args(EngineArgs(model=str(llama_dir), device="cpu", allowed_media_domains=["a.org"],
                                               allowed_local_media_path=str(tmp_path),
                                               limit_mm_per_prompt='{"image": 3}', media_fetch_timeout=1.5))
    assert config.media == MediaConfig(frozenset({"a.org"}), os.path.realpath(tmp_path), (("image", 3),), 1.5)
    assert EngineConfig.from_args(EngineArgs(model=str(llama_dir), device="cpu")).media == MediaConfig()
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        EngineConfig.from_args(EngineArgs(model=str(llama_dir), device="cpu", limit_mm_per_prompt="{"))
