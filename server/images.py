"""Image content parts of chat requests: fetch (data URLs; http(s) only with `--allow-image-urls`, public hosts only
unless `--allow-private-image-urls`; local files never), decode with limits, and preprocess as transformers'
processor does (`nemotron.vision_preprocess`). The prompt's image-token expansion is
`nemotron.vision_prompt.encode_prompt`. Every problem is an `APIError` 400 that says what is wrong."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass

import numpy as np
import torch

from nemotron import vision_preprocess as vp
from procs.messages import Images
from server.errors import APIError

# Pillow format names we accept, and the data-URL media types that name them.
SUPPORTED_FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP"}
MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp"}
MAX_URL_BYTES = 64 << 20


@dataclass
class ImageInputs:
    """What the compute process needs: pixel values of all images (rows in image order), their grids, the
    positions of their `<image>` tokens in the prompt (flat, in order) and a digest of each image."""
    pixel_values: torch.Tensor      # (sum of patches, 3*P*P) fp32
    grid_hw: list[list[int]]
    positions: list[int]
    digests: list[str]

    def message(self) -> Images:
        return Images(pixel_values=self.pixel_values.contiguous().numpy().astype("<f4").tobytes(),
                      n_rows=int(self.pixel_values.shape[0]), row_size=int(self.pixel_values.shape[1]),
                      grid_hw=[list(g) for g in self.grid_hw], positions=list(self.positions),
                      digests=list(self.digests))


def _bad(msg: str) -> APIError:
    return APIError(400, msg, param="messages", code="invalid_image")


MAX_REDIRECTS = 5


def check_destination(url: str, allow_private: bool) -> None:
    """Refuse a URL whose host resolves to a loopback, private, link-local, multicast or reserved address (the
    server's own services, the LAN, a cloud metadata endpoint) unless the operator allowed private hosts.
    Every address the name resolves to must be public. The check runs again for each redirect."""
    import ipaddress
    import socket

    import httpx
    try:
        host = httpx.URL(url).host
    except Exception as e:      # noqa: BLE001 - httpx raises several kinds for a malformed URL
        raise _bad(f"the image URL is malformed ({e})") from e
    if not host:
        raise _bad("the image URL has no host")
    if allow_private:
        return
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as e:
        raise _bad(f"the image URL's host {host!r} does not resolve ({e})") from e
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        inner = embedded_ipv4(ip) if ip.version == 6 else None
        if not ip.is_global or (inner is not None and not inner.is_global):
            shown = f"{ip}, which carries {inner}" if inner is not None else str(ip)
            raise _bad(f"the image URL's host {host!r} is a non-public address ({shown}); this server fetches only "
                       "public hosts (start it with --allow-private-image-urls to allow LAN hosts)")


def embedded_ipv4(ip):
    """The IPv4 address inside an IPv6 address that reaches it (None: none). Python's `is_global` judges these
    as IPv6 and calls them public, yet each one routes to its IPv4 address: IPv4-mapped `::ffff:a.b.c.d`,
    IPv4-compatible `::a.b.c.d`, NAT64 `64:ff9b::/96` and `64:ff9b:1::/48`, 6to4 `2002:AABB:CCDD::/48`, Teredo
    (the client address) and ISATAP (`...:0:5efe:a.b.c.d`)."""
    import ipaddress
    n = int(ip)
    low32 = ipaddress.IPv4Address(n & 0xFFFFFFFF)
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if n >> 32 == 0 and n > 1:                                  # ::a.b.c.d (:: and ::1 are IPv6's own)
        return low32
    if ip in ipaddress.ip_network("64:ff9b::/96") or ip in ipaddress.ip_network("64:ff9b:1::/48"):
        return low32
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if (n >> 32) & 0xFDFFFFFF == 0x5EFE:                        # ISATAP interface id, u/l bit either way
        return low32
    return None


def fetch(url: str, allow_urls: bool, allow_private: bool = False) -> bytes:
    """The encoded bytes behind an `image_url`."""
    if not isinstance(url, str) or not url:
        raise _bad("an image_url part needs a url")
    low = url[:16].lower()
    if low.startswith("data:"):
        header, sep, payload = url.partition(",")
        media = header[5:].split(";")[0].strip().lower()
        if not sep or not header.lower().endswith(";base64"):
            raise _bad("image data URLs must be base64 (data:image/png;base64,...)")
        if media and media not in MEDIA_TYPES:
            raise _bad(f"unsupported image type {media!r} in the data URL; supported: "
                       f"{', '.join(sorted(MEDIA_TYPES))}")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _bad(f"the image data URL is not valid base64 ({e})") from e
    if low.startswith(("http://", "https://")):
        if not allow_urls:
            raise _bad("image URLs (http/https) are disabled on this server; send the image as a base64 data URL "
                       "(data:image/png;base64,...) or start the server with --allow-image-urls")
        import httpx
        try:
            for _ in range(MAX_REDIRECTS + 1):
                check_destination(url, allow_private)
                with httpx.stream("GET", url, timeout=30, follow_redirects=False) as r:
                    if r.is_redirect:
                        url = str(r.url.join(r.headers.get("location", "")))
                        if not url.lower().startswith(("http://", "https://")):
                            raise _bad("the image URL redirects to a non-http(s) location")
                        continue
                    if r.status_code != 200:
                        raise _bad(f"fetching the image URL gave HTTP {r.status_code}")
                    buf = bytearray()
                    for chunk in r.iter_bytes():
                        buf += chunk
                        if len(buf) > MAX_URL_BYTES:
                            raise _bad(f"the image at the URL is larger than {MAX_URL_BYTES >> 20} MiB")
                    return bytes(buf)
            raise _bad(f"the image URL redirects more than {MAX_REDIRECTS} times")
        except httpx.HTTPError as e:
            raise _bad(f"the image URL could not be fetched: {type(e).__name__}: {e}") from e
    if low.startswith("file:") or url.startswith(("/", ".", "~")) or (len(url) > 2 and url[1:3] in (":\\", ":/")):
        raise _bad("local files are never read; send the image as a base64 data URL (data:image/png;base64,...)")
    raise _bad(f"unsupported image URL scheme in {url[:24]!r}...; send a base64 data URL "
               "(data:image/png;base64,...)")


def decode(data: bytes, max_pixels: int) -> torch.Tensor:
    """Encoded bytes -> uint8 (3, H, W), after checking the format and the pixel count from the header."""
    from PIL import Image, UnidentifiedImageError
    if not data:
        raise _bad("the image is empty")
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, (w, h) = im.format, im.size
    except Image.DecompressionBombError as e:
        raise _bad(f"the image has too many pixels ({e})") from e
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise _bad(f"the image could not be decoded: not a recognized image format ({type(e).__name__})") from e
    if fmt not in SUPPORTED_FORMATS:
        raise _bad(f"unsupported image format {fmt}; supported: {', '.join(sorted(SUPPORTED_FORMATS))}")
    if w * h > max_pixels:
        raise _bad(f"the image is {w}x{h} = {w * h} pixels, over this server's limit of {max_pixels} pixels "
                   "(--max-image-pixels)")
    try:
        return vp.decode_image(data)
    except Image.DecompressionBombError as e:
        raise _bad(f"the image has too many pixels ({e})") from e
    except Exception as e:
        raise _bad(f"the {fmt} image could not be decoded ({type(e).__name__}: {e})") from e


def digest(pixel_values: torch.Tensor, grid) -> str:
    h = hashlib.sha256(np.asarray(grid, dtype="<i8").tobytes())
    h.update(pixel_values.contiguous().numpy().astype("<f4").tobytes())
    return h.hexdigest()


class Grids(list):
    """The `[gh, gw]` rows of a request's images, one per image (dynamic scheme) or one per tile with the
    thumbnail last (tiled scheme), in image order: what the compute process runs the tower on, each row as an
    image of its own. `grids_per_image` says how many consecutive rows each image has, for the prompt
    expansion (one `<img>...</img>` per image). A plain list to everything else (msgpack sends it as one)."""

    def __init__(self, rows, grids_per_image=None):
        super().__init__(rows)
        self.grids_per_image = list(grids_per_image) if grids_per_image is not None else [1] * len(self)


def preprocess(images: list[torch.Tensor], geom: vp.ImageGeometry) -> tuple[torch.Tensor, Grids, list[str]]:
    """-> pixel values, grid rows and one digest per grid row (per tile in the tiled scheme: the compute
    process keys snapshots and runs the tower per row; a tile's embeddings depend on its pixels only)."""
    try:
        pv, grid, per_image = vp.preprocess_images(images, geom)
    except ValueError as e:
        raise _bad(f"the image cannot be used: {e}") from e
    grid = Grids(grid.tolist(), per_image)
    out, row = [], 0
    for g in grid:
        n = g[0] * g[1]
        out.append(digest(pv[row:row + n], g))
        row += n
    return pv, grid, out
