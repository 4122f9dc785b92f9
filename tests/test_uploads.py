"""Uploads (issue 23, images): bombs refused before a pixel is decoded, damaged files answered
400, every pixel mode read as a viewer shows it (or refused by name), EXIF orientation, the
first frame of an animation, base64 as tools write it, an image's text read without decoding;
then the five upload routes of a real server, which answer the same and keep /health quick.

References are independent of runtime/pipeline/uploads.py: numpy arithmetic on the values put in,
colorsys, the CIE formulas, Pillow's own readers (``ImageOps.exif_transpose``, ``.text``).
"""

from __future__ import annotations

import base64
import colorsys
import io
import json
import struct
import subprocess
import sys
import threading
import time
import timeit
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import ExifTags, Image, ImageOps, PngImagePlugin

from edit_rt.runtime.errors import ImageInputError
from edit_rt.runtime.pipeline.uploads import _rgb, decode_base64, image_from_bytes, text_of_image

from .server_process import ServerProcess

MAX_PIXELS = 25_000_000  # serve.max_image_pixels' default
RNG = np.random.default_rng(7)


# --- files built byte by byte ---------------------------------------------------------------


def _chunk(cid: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + cid + data + struct.pack(">I", zlib.crc32(cid + data))


def _png_declaring(width: int, height: int, idat: bytes = zlib.compress(b"\0" * 64)) -> bytes:
    """An RGB PNG whose header claims ``width x height`` and whose pixel data is a few bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _png_of_zeros(width: int, height: int, depth: int, colour: int, channels: int) -> bytes:
    """A complete, valid black PNG: its zero rows deflate ~1000:1 (a 1-bit 13000x13000 is 20 KB)."""
    deflate, row = zlib.compressobj(9), b"\0" * (1 + (width * channels * depth + 7) // 8)
    idat = b"".join(deflate.compress(row) for _ in range(height)) + deflate.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _jpeg_declaring(width: int, height: int) -> bytes:
    data = bytearray(_encoded(Image.new("RGB", (16, 16)), "JPEG"))
    sof = data.find(b"\xff\xc0")  # SOF0: length(2) precision(1) height(2) width(2)
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _gif_declaring(width: int, height: int) -> bytes:
    screen = struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"  # 2-colour table
    frame = b"," + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00"  # one pixel
    return b"GIF89a" + screen + frame + b";"


def _tiff_declaring(width: int, height: int) -> bytes:
    entries = [(256, 4, width), (257, 4, height), (258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, 8 + 2 + 9 * 12 + 4),
               (277, 3, 1), (278, 4, height), (279, 4, 16)]  # fmt: skip
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", t, k, 1, v) for t, k, v in entries)
    return b"II*\0" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0) + b"\0" * 16


def _webp_declaring(width: int, height: int) -> bytes:
    data = bytearray(_encoded(Image.new("RGB", (16, 16)), "WEBP", lossless=True))
    bits = struct.unpack("<I", data[21:25])[0] & ~((1 << 28) - 1)  # VP8L: 14 bits each, size - 1
    data[21:25] = struct.pack("<I", bits | (width - 1) | ((height - 1) << 14))
    return bytes(data)


def _encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def _take(data: bytes, size=(32, 32), resize: bool = False, max_pixels: int = MAX_PIXELS):
    return image_from_bytes(data, size, "image", 10**7, resize, max_pixels)


def _refusal(data: bytes, size=(32, 32), max_pixels: int = MAX_PIXELS) -> ImageInputError:
    with pytest.raises(ImageInputError) as err:
        _take(data, size, True, max_pixels)
    return err.value


def _as_uint8(upload) -> np.ndarray:
    return np.rint(upload.pixels * 255).astype(np.int64)


BOMBS = {
    "png 20000x20000 header": lambda: _png_declaring(20000, 20000),
    "png 1-bit 13000x13000": lambda: _png_of_zeros(13000, 13000, 1, 0, 1),
    "png rgb 9000x9000": lambda: _png_of_zeros(9000, 9000, 8, 2, 3),
    "jpeg 65000x65000": lambda: _jpeg_declaring(65000, 65000),
    "gif 65535x65535": lambda: _gif_declaring(65535, 65535),
    "tiff 100000x100000": lambda: _tiff_declaring(100000, 100000),
    "webp 16383x16383": lambda: _webp_declaring(16383, 16383),
}

# Run in a fresh interpreter: its peak RSS then measures these calls alone (Pillow's memory is
# invisible to tracemalloc, and this process's peak is already set by earlier tests).
MEASURE = """
import json, resource, sys
from edit_rt.runtime.pipeline.uploads import ImageInputError, image_from_bytes, text_of_image
out, base = {}, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for path in sys.argv[1:]:
    data = open(path, "rb").read()
    for name, call in (("pixels", lambda: image_from_bytes(data, (32, 32), "image", 10**7, True, 25_000_000)),
                       ("text", lambda: text_of_image(data, "image", 10**7, 25_000_000))):
        try:
            call(); status, message = 200, ""
        except ImageInputError as err:
            status, message = err.status, str(err)
        out[path + ":" + name] = [status, message]
out["rss_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(json.dumps(out))
"""


def test_image_bombs_are_refused_from_their_header_without_decoding(tmp_path):
    paths = []
    for k, make in enumerate(BOMBS.values()):
        paths.append(tmp_path / f"bomb{k}")
        paths[-1].write_bytes(make())
    assert max(p.stat().st_size for p in paths) < 300_000  # small files (the 9000x9000: 236 KB)
    run = subprocess.run([sys.executable, "-c", MEASURE, *map(str, paths)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "DecompressionBomb" not in run.stderr  # no warning printed either
    out = json.loads(run.stdout)
    for name, path in zip(BOMBS, paths):
        for call in ("pixels", "text"):
            status, message = out[f"{path}:{call}"]
            assert status == 413 and f"at most {MAX_PIXELS} (serve.max_image_pixels)" in message, (name, message)
    assert out["rss_mb"] < 100, out["rss_mb"]  # decoding the 9000x9000 alone would take 324 MB


def test_the_declared_size_is_compared_with_the_limit():
    exactly = _png_of_zeros(100, 50, 8, 2, 3)
    assert _take(exactly, (100, 50), max_pixels=5000).pixels.shape == (50, 100, 3)
    assert _refusal(exactly, (100, 50), max_pixels=4999).status == 413
    assert "100x50 is 5000 pixels, at most 4999" in str(_refusal(exactly, max_pixels=4999))


def test_pillows_own_bomb_check_never_escapes(monkeypatch):
    """Were Pillow's limit set again (by another library), its error and its warning are the
    same 413; under the default nothing is printed for a 100 M-pixel claim."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _refusal(_png_declaring(10000, 10000)).status == 413
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    error = _refusal(_png_declaring(64, 64))  # past twice the limit: DecompressionBombError
    assert error.status == 413 and "serve.max_image_pixels" in str(error)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        error = _refusal(_png_declaring(40, 40))  # 1600: the warning, raised
    assert error.status == 413 and "serve.max_image_pixels" in str(error)


# --- damaged files --------------------------------------------------------------------------


def _valid(fmt: str, **options) -> bytes:
    return _encoded(Image.fromarray(RNG.integers(0, 255, (64, 64, 3), np.uint8)), fmt, **options)


def _bad_ihdr_crc() -> bytes:
    data = bytearray(_valid("PNG"))
    data[29] ^= 0xFF  # IHDR's CRC
    return bytes(data)


DAMAGED = {
    "empty": lambda: b"",
    "text": lambda: b"not an image at all",
    "png truncated": lambda: _valid("PNG")[: len(_valid("PNG")) // 2],
    "png bad ihdr crc": _bad_ihdr_crc,
    "png idat not zlib": lambda: _png_declaring(32, 32, idat=b"\x78\x9c garbage"),
    "png idat short": lambda: _png_declaring(32, 32, idat=zlib.compress(b"\0" * 10)),
    "jpeg truncated": lambda: _valid("JPEG")[:600],
    "gif truncated": lambda: _valid("GIF")[:200],
    "tiff truncated": lambda: _valid("TIFF")[:3000],
    "bmp truncated": lambda: _valid("BMP")[:1000],
    "webp truncated": lambda: _valid("WEBP")[:100],
    "ico (not a format served)": lambda: _valid("ICO"),
    "psd-like header": lambda: b"8BPS" + b"\0" * 100,
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_damaged_files_are_400_not_an_image(name):
    error = _refusal(DAMAGED[name]())
    assert error.status == 400 and str(error).startswith("image: not an image this server reads"), str(error)


# --- modes ----------------------------------------------------------------------------------

GREY = RNG.integers(0, 256, (32, 32), dtype=np.uint8)
COLOUR = RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8)
WIDE = RNG.integers(0, 65536, (32, 32)).astype(np.uint16)


def _grey3(values: np.ndarray) -> np.ndarray:
    return np.repeat(values.astype(np.float64)[..., None], 3, axis=2)


def _paletted() -> tuple[Image.Image, np.ndarray]:
    palette = RNG.integers(0, 256, (256, 3), dtype=np.uint8)
    image = Image.frombytes("P", (32, 32), GREY.tobytes())
    image.putpalette(palette.tobytes())
    return image, palette[GREY].astype(np.float64)


def _lab_to_srgb(l_star: np.ndarray) -> np.ndarray:
    """Neutral CIELab (a* = b* = 0) to sRGB 0..255: the CIE inverse, then the sRGB curve."""
    f = (l_star + 16) / 116
    y = np.where(f > 6 / 29, f**3, 3 * (6 / 29) ** 2 * (f - 4 / 29))
    srgb = np.where(y <= 0.0031308, 12.92 * y, 1.055 * y ** (1 / 2.4) - 0.055)
    return 255 * srgb


def _ycbcr_to_rgb(ycc: np.ndarray) -> np.ndarray:
    """JFIF's full-range YCbCr (ITU-T T.871)."""
    y, cb, cr = (ycc[..., i].astype(np.float64) for i in range(3))
    rgb = np.stack([y + 1.402 * (cr - 128), y - 0.344136 * (cb - 128) - 0.714136 * (cr - 128), y + 1.772 * (cb - 128)], -1)
    return np.clip(rgb, 0, 255)


def _file_modes():
    """(mode, file bytes, the RGB 0..255 a viewer shows, tolerance in 8-bit levels)."""
    bits = GREY > 127
    yield "1", _encoded(Image.fromarray(bits), "PNG"), _grey3(bits * 255.0), 0
    yield "L", _encoded(Image.fromarray(GREY), "PNG"), _grey3(GREY), 0
    la = Image.merge("LA", (Image.fromarray(GREY), Image.new("L", (32, 32), 255)))
    yield "LA", _encoded(la, "PNG"), _grey3(GREY), 0
    paletted, shown = _paletted()
    yield "P", _encoded(paletted, "PNG"), shown, 0
    pa = paletted.convert("PA")
    yield "PA", _encoded(pa, "TIFF"), shown, 0
    yield "RGBA", _encoded(Image.fromarray(np.dstack([COLOUR, np.full((32, 32), 255, np.uint8)])), "PNG"), COLOUR, 0
    cmyk = RNG.integers(0, 256, (32, 32, 4), dtype=np.uint8)
    white = (255.0 - cmyk[..., :3]) * (255.0 - cmyk[..., 3:]) / 255  # no profile: the plain formula
    yield "CMYK", _encoded(Image.frombytes("CMYK", (32, 32), cmyk.tobytes()), "TIFF"), white, 1
    ycc = RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    yield "YCbCr", _encoded(Image.frombytes("YCbCr", (32, 32), ycc.tobytes()), "TIFF"), _ycbcr_to_rgb(ycc), 2
    lab = np.dstack([GREY, np.zeros((32, 32, 2), np.uint8)])  # TIFF's CIELab bytes: L* x 2.55, a*/b* signed
    yield "LAB", _encoded(Image.frombytes("LAB", (32, 32), lab.tobytes()), "TIFF"), _grey3(_lab_to_srgb(GREY / 2.55)), 2
    yield "I;16", _encoded(Image.fromarray(WIDE), "PNG"), _grey3(WIDE / 65535 * 255), 0.5
    big_endian = Image.frombytes("I;16B", (32, 32), WIDE.astype(">u2").tobytes())
    yield "I;16B", _encoded(big_endian, "TIFF"), _grey3(WIDE / 65535 * 255), 0.5
    yield "I", _encoded(Image.fromarray(WIDE.astype(np.int32)), "TIFF"), _grey3(WIDE / 65535 * 255), 0.5
    unit = RNG.random((32, 32), dtype=np.float32)
    yield "F", _encoded(Image.fromarray(unit), "TIFF"), _grey3(unit * 255.0), 0.5


FILE_MODES = list(_file_modes())


@pytest.mark.parametrize("mode,data,shown,tolerance", FILE_MODES, ids=[m[0] for m in FILE_MODES])
def test_every_file_mode_reads_as_a_viewer_shows_it(mode, data, shown, tolerance):
    assert Image.open(io.BytesIO(data)).mode == mode  # the file holds the mode under test
    upload = _take(data)
    assert upload.pixels.shape == (32, 32, 3) and upload.pixels.dtype == np.float32
    assert 0.0 <= upload.pixels.min() and upload.pixels.max() <= 1.0
    assert np.abs(upload.pixels * 255 - shown).max() <= tolerance + 1e-3, mode
    assert upload.notes and mode in upload.notes[0]


def test_sixteen_bit_grey_spans_black_to_white():
    """The issue's 'all white': a 0..65535 gradient must read 0..1, not clip at 255."""
    ramp = np.linspace(0, 65535, 32 * 32).round().astype(np.uint16).reshape(32, 32)
    for data in (_encoded(Image.fromarray(ramp), "PNG"), _encoded(Image.fromarray(ramp), "TIFF")):
        pixels = _take(data).pixels
        np.testing.assert_allclose(pixels[..., 0], ramp / 65535, atol=0.5 / 255 + 1e-6)
        assert pixels.min() == 0.0 and pixels.max() == 1.0


@pytest.mark.parametrize(
    "values,needle",
    [
        (np.full((32, 32), 70000, np.int32), "32-bit integer pixels from 70000 to 70000"),
        (np.full((32, 32), -1, np.int32), "32-bit integer pixels from -1 to -1"),
        (np.full((32, 32), 255.0, np.float32), "float pixels from 255 to 255"),
        (np.full((32, 32), -0.5, np.float32), "float pixels from -0.5 to -0.5"),
        (np.full((32, 32), np.nan, np.float32), "float pixels from nan to nan"),
    ],
)
def test_integer_and_float_tiffs_outside_their_scale_are_refused_not_clipped(values, needle):
    error = _refusal(_encoded(Image.fromarray(values), "TIFF"))
    assert error.status == 400 and needle in str(error), str(error)


def test_modes_no_file_carries_convert_too():
    """HSV, La, RGBa, RGBX, I;16L, I;16N arise in Pillow, not from the formats served: the
    conversion (a private step of image_from_bytes) still reads them right."""
    hsv = RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    expected = np.array([[colorsys.hsv_to_rgb(*(c / 255)) for c in row] for row in hsv]) * 255
    cases = {
        "HSV": (Image.frombytes("HSV", (32, 32), hsv.tobytes()), expected, 1),
        "La": (Image.frombytes("La", (32, 32), np.dstack([GREY, np.full_like(GREY, 255)]).tobytes()), _grey3(GREY), 0),
        "RGBa": (Image.frombytes("RGBa", (32, 32), np.dstack([COLOUR, np.full_like(GREY, 255)]).tobytes()), COLOUR, 0),
        "RGBX": (Image.frombytes("RGBX", (32, 32), np.dstack([COLOUR, GREY]).tobytes()), COLOUR, 0),
        "I;16L": (Image.frombytes("I;16L", (32, 32), WIDE.astype("<u2").tobytes()), _grey3(WIDE / 65535 * 255), 0.5),
        "I;16N": (Image.frombytes("I;16N", (32, 32), WIDE.astype("=u2").tobytes()), _grey3(WIDE / 65535 * 255), 0.5),
    }
    for mode, (image, shown, tolerance) in cases.items():
        notes = []
        rgb = np.asarray(_rgb(image, "image", notes), np.float64)
        assert np.abs(rgb - shown).max() <= tolerance + 1e-6, mode
        assert mode in notes[0]


def test_every_pillow_mode_converts_or_is_refused_by_name():
    for mode in Image.MODES:
        bands = len(Image.new(mode, (1, 1)).getbands())
        opaque = (0,) * (bands - 1) + (255,) if mode in ("LA", "La", "PA", "RGBA", "RGBa") else None
        try:
            assert _rgb(Image.new(mode, (4, 4), opaque), "image", []).mode == "RGB"
        except ImageInputError as err:
            assert mode in str(err)


def _one_transparent(mode: str) -> bytes:
    if mode in ("RGBA", "LA"):
        bands = (COLOUR if mode == "RGBA" else GREY[..., None]).copy()
        alpha = np.full((32, 32, 1), 255, np.uint8)
        alpha[3, 4] = 0
        return _encoded(Image.fromarray(np.concatenate([bands, alpha], -1).squeeze()), "PNG")
    if mode == "PA":
        pa = _paletted()[0].convert("PA")
        pa.putpixel((4, 3), (GREY[3, 4], 0))
        return _encoded(pa, "TIFF")
    if mode == "P":
        return _encoded(_paletted()[0], "PNG", transparency=int(GREY[3, 4]))
    key = WIDE if mode == "I;16" else GREY
    return _encoded(Image.fromarray(key), "PNG", transparency=int(key[3, 4]))


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA", "P", "L", "I;16"])
def test_transparent_pixels_are_refused_in_every_mode(mode):
    # one pixel's alpha is 0; a transparency key also hides every other pixel of its value
    count = {"P": (GREY == GREY[3, 4]).sum(), "L": (GREY == GREY[3, 4]).sum(), "I;16": (WIDE == WIDE[3, 4]).sum()}.get(mode, 1)
    error = _refusal(_one_transparent(mode))
    assert error.status == 400 and f"{count} transparent pixels" in str(error), str(error)


# --- orientation and frames -----------------------------------------------------------------

PICTURE = RNG.integers(0, 256, (32, 48, 3), dtype=np.uint8)  # 48 wide, 32 high: turning shows


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_turns_the_image_upright(orientation):
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation
    data = _encoded(Image.fromarray(PICTURE), "PNG", exif=exif)
    upright = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    numpy_turn = {6: np.rot90(PICTURE, -1), 8: np.rot90(PICTURE, 1), 3: np.rot90(PICTURE, 2)}.get(orientation)
    if numpy_turn is not None:
        assert np.array_equal(upright, numpy_turn)  # Pillow's reference agrees with numpy's turn
    upload = _take(data, (upright.shape[1], upright.shape[0]))  # checked against the upright size
    assert np.array_equal(_as_uint8(upload), upright)
    assert (orientation == 1) != any("EXIF orientation" in n for n in upload.notes)


def test_exif_rotated_jpeg_equals_its_turned_pixels():
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6
    data = _encoded(Image.fromarray(PICTURE), "JPEG", exif=exif, quality=95)
    stored = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))  # as decoded, unturned
    upload = _take(data, (32, 48))
    assert np.array_equal(_as_uint8(upload), np.rot90(stored, -1))
    assert "turned upright (EXIF orientation 6)" in upload.notes


def _frames() -> list[Image.Image]:
    return [Image.new("RGB", (32, 32), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]


@pytest.mark.parametrize("fmt,options", [("GIF", {}), ("PNG", {}), ("WEBP", {"lossless": True}), ("TIFF", {})])
def test_an_animated_or_multi_page_image_gives_its_first_frame(fmt, options):
    first, *rest = _frames()
    data = _encoded(first, fmt, save_all=True, append_images=rest, **options)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 3
    upload = _take(data)
    assert np.array_equal(_as_uint8(upload), np.broadcast_to([255, 0, 0], (32, 32, 3)))
    assert any("first frame" in n for n in upload.notes)


# --- base64 ---------------------------------------------------------------------------------


def test_base64_with_line_breaks_spaces_and_a_data_url_is_read():
    data = _valid("PNG")
    plain = base64.b64encode(data).decode()
    wrapped = base64.encodebytes(data).decode()  # the base64 tool's 76-character lines
    assert wrapped.count("\n") > 10
    spaced = " ".join(plain[i : i + 10] for i in range(0, len(plain), 10))
    for text in (wrapped, wrapped.replace("\n", "\r\n"), spaced, "data:image/png;base64," + wrapped,
                 "data:image/png;base64," + plain, "data:image/jpeg;base64," + plain):  # fmt: skip
        assert decode_base64(text, "image") == data


NOT_BASE64 = [("not base64!", "not base64"), ("QUJD\nR", "not base64"), ("é", "not base64"), ("QUJD-_", "not base64"),
              ("data:image/png,abc", "must be base64"), ("data:image/png;base64", "must be base64")]  # fmt: skip


@pytest.mark.parametrize("text,needle", NOT_BASE64)
def test_what_is_not_base64_is_refused(text, needle):
    with pytest.raises(ImageInputError, match=needle) as err:
        decode_base64(text, "image")
    assert err.value.status == 400 and str(err.value).startswith("image: ")


def test_a_body_sized_base64_decodes_in_linear_time():
    data = RNG.integers(0, 256, 11_000_000, dtype=np.uint8).tobytes()  # ~ serve.max_body_bytes as base64
    seconds = {}
    for size in (len(data) // 10, len(data)):
        text = base64.encodebytes(data[:size]).decode()
        assert decode_base64(text, "image") == data[:size]
        seconds[size] = min(timeit.repeat(lambda: decode_base64(text, "image"), number=1, repeat=3))
    # a ratio within this run: 10x the text takes ~10x the time; a quadratic decode, ~100x
    assert seconds[len(data)] < 30 * seconds[len(data) // 10], seconds


# --- text -----------------------------------------------------------------------------------


def _with_text_after_idat(data: bytes, key: str, value: str) -> bytes:
    iend = data.rfind(b"IEND") - 4
    return data[:iend] + _chunk(b"tEXt", f"{key}\0{value}".encode("latin-1")) + data[iend:]


def test_png_text_is_read_wherever_it_lies_without_decoding():
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", "a red circle\nSteps: 20, Base id: abc")
    info.add_text("compressed", "z" * 500, zip=True)
    info.add_itxt("international", "ünïcode", lang="de")
    data = _with_text_after_idat(_valid("PNG", pnginfo=info), "after", "written after the pixels")
    reference = Image.open(io.BytesIO(data))
    reference.load()
    assert text_of_image(data, "image", 10**7, MAX_PIXELS) == {k: str(v) for k, v in reference.text.items()}
    # a bomb carrying the same text is refused like any upload, its pixels never inflated
    bomb = _with_text_after_idat(_png_of_zeros(13000, 13000, 1, 0, 1), "parameters", "x")
    with pytest.raises(ImageInputError) as err:
        text_of_image(bomb, "image", 10**7, MAX_PIXELS)
    assert err.value.status == 413


def test_jpeg_text_comes_from_its_exif_user_comment_or_comment():
    exif = Image.Exif()
    exif.get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.UserComment] = b"UNICODE\0" + "Steps: 20, Seed: 1".encode("utf_16_be")
    text = text_of_image(_valid("JPEG", exif=exif, comment=b"a comment"), "image", 10**7, MAX_PIXELS)
    assert text["parameters"] == "Steps: 20, Seed: 1" and text["comment"] == "a comment"
    assert text_of_image(_valid("GIF", comment=b"only this"), "image", 10**7, MAX_PIXELS)["parameters"] == "only this"


@pytest.mark.parametrize("damage", ["bad crc", "ztxt bomb", "truncated"])
def test_damaged_text_is_400(damage):
    data = _valid("PNG")
    if damage == "bad crc":
        data = bytearray(_with_text_after_idat(data, "k", "v"))
        data[-16] ^= 0xFF  # the tEXt chunk's CRC
    elif damage == "ztxt bomb":  # 64 MB of text in 64 KB: Pillow's text limit holds
        iend = data.rfind(b"IEND") - 4
        data = data[:iend] + _chunk(b"zTXt", b"k\0\0" + zlib.compress(b"a" * 64_000_000, 9)) + data[iend:]
    else:
        data = data[: len(data) // 2]
    with pytest.raises(ImageInputError, match="not an image") as err:
        text_of_image(bytes(data), "image", 10**7, MAX_PIXELS)
    assert err.value.status == 400


# --- the five routes of a real server -------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = ServerProcess(tmp_path_factory.mktemp("uploads"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


def _post(url: str, route: str, data: bytes) -> httpx.Response:
    encoded = base64.b64encode(data).decode()
    if route == "bases":
        return httpx.post(url + "/v1/bases", json={"image": encoded}, timeout=120)
    if route == "edits json":
        body = {"image": encoded, "source_prompt": "x", "edits": [{"prompt": "a blue square", "tail_steps": 3}]}
        return httpx.post(url + "/v1/images/edits", json=body, timeout=120)
    if route == "edits form":
        return httpx.post(url + "/v1/images/edits", files={"image": ("x.png", data, "image/png")},
                          data={"prompt": "a blue square"}, timeout=120)  # fmt: skip
    if route == "img2img":
        return httpx.post(url + "/sdapi/v1/img2img", json={"init_images": [encoded], "prompt": "a blue square"}, timeout=120)
    return httpx.post(url + "/sdapi/v1/png-info", json={"image": encoded}, timeout=120)


ROUTES = {"bases": "image", "edits json": "image", "edits form": "image", "img2img": "init_images[0]", "png-info": "image"}


@pytest.mark.slow
@pytest.mark.parametrize("route", list(ROUTES))
def test_every_upload_route_refuses_bombs_and_damage_in_the_api_shape(server, route):
    cases = [(BOMBS["png 20000x20000 header"](), 413), (BOMBS["gif 65535x65535"](), 413),
             (BOMBS["png 1-bit 13000x13000"](), 413), (BOMBS["jpeg 65000x65000"](), 413),
             (b"not an image", 400), (DAMAGED["png bad ihdr crc"](), 400)]  # fmt: skip
    for data, status in cases:
        r = _post(server.url, route, data)
        assert r.status_code == status, (route, r.status_code, r.text)
        assert r.json()["error"]["param"] == ROUTES[route]
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


@pytest.mark.slow
def test_health_answers_while_large_uploads_decode(server):
    """25-megapixel images (the most allowed) sent together to a real server are all decoded
    while /health goes on answering. That the decodes run off the event loop is held in-process
    by test_image_deadline.py (a decode held in its worker while another upload is served); this
    test times nothing."""
    y, x = np.mgrid[0:5000, 0:5000]
    big = _encoded(Image.fromarray(np.dstack([(x + y) % 256, (x * 3) % 256, (y * 7) % 256]).astype(np.uint8)), "PNG")
    assert len(base64.b64encode(big)) < 16_000_000
    done, statuses = threading.Event(), []

    def poll():
        while not done.is_set():
            statuses.append(httpx.get(server.url + "/health", timeout=30).status_code)  # the timeout: a hang guard
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    with ThreadPoolExecutor(4) as pool:
        poller.start()
        answers = list(pool.map(lambda _: _post(server.url, "bases", big), range(4)))
    done.set()
    poller.join()
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    assert statuses and set(statuses) == {200}, statuses
