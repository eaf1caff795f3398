#!/usr/bin/env python3
"""Checks train/plot.cpp's PNG files with an independent decoder (Python's zlib).

  check_png.py PNG_FILE RAW_RGB_FILE  PNG_FILE is a valid 8-bit RGB PNG whose pixels are RAW_RGB_FILE's

Prints "ok" and exits 0, or prints a one-line reason and exits 1. Used by tests/test_plot.cpp; standard
library only.
"""
import struct
import sys
import zlib

SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Mismatch(Exception):
    pass


def read(path):
    with open(path, "rb") as f:
        return f.read()


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"byte {i}: {x} != {y}"
    return f"lengths {len(a)} != {len(b)}"


def inflate(stream, what):
    try:
        return zlib.decompress(stream)  # also checks the header and the Adler-32 trailer
    except zlib.error as e:
        raise Mismatch(f"{what} does not inflate: {e}")


def chunks(png):
    """The (type, data) chunks after the signature, each CRC checked."""
    if png[:8] != SIGNATURE:
        raise Mismatch("no PNG signature")
    at = 8
    while at < len(png):
        if at + 12 > len(png):
            raise Mismatch(f"truncated chunk at byte {at}")
        (length,) = struct.unpack(">I", png[at:at + 4])
        body = png[at + 4:at + 8 + length]  # type and data: what the CRC covers
        crc = png[at + 8 + length:at + 12 + length]
        if len(crc) != 4:
            raise Mismatch(f"chunk {body[:4]!r} at byte {at} runs past the end")
        if zlib.crc32(body) != struct.unpack(">I", crc)[0]:
            raise Mismatch(f"chunk {body[:4]!r} at byte {at} has a wrong CRC")
        yield body[:4], body[4:]
        at += 12 + length


def unfilter(data, width, height):
    """The RGB bytes of a filtered 8-bit RGB image (RFC 2083 6: filter types 0-4, 3 bytes per pixel)."""
    stride, bpp = width * 3, 3
    if len(data) != height * (stride + 1):
        raise Mismatch(f"the image data has {len(data)} bytes, not {height} rows of 1 + {stride}")
    out = bytearray()
    previous = bytearray(stride)
    for y in range(height):
        filter_type = data[y * (stride + 1)]
        row = bytearray(data[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = row[i - bpp] if i >= bpp else 0
            b = previous[i]
            c = previous[i - bpp] if i >= bpp else 0
            if filter_type == 0:
                predicted = 0
            elif filter_type == 1:
                predicted = a
            elif filter_type == 2:
                predicted = b
            elif filter_type == 3:
                predicted = (a + b) // 2
            elif filter_type == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                predicted = a if pa <= pb and pa <= pc else b if pb <= pc else c
            else:
                raise Mismatch(f"row {y} has filter type {filter_type}")
            row[i] = (row[i] + predicted) & 0xFF
        out += row
        previous = row
    return bytes(out)


def check_png(png_path, raw_path):
    found = list(chunks(read(png_path)))
    types = [t for t, _ in found]
    if not types or types[0] != b"IHDR" or types[-1] != b"IEND" or found[-1][1]:
        raise Mismatch(f"chunks {types}: expected IHDR first and an empty IEND last")
    # Ancillary chunks (a lower-case first letter: cairo writes bKGD) may be ignored; critical ones may not.
    critical = {t for t in types if t[:1].isupper()}
    if critical - {b"IHDR", b"IDAT", b"IEND"} or types.count(b"IHDR") != 1 or types.count(b"IEND") != 1:
        raise Mismatch(f"chunks {types}: expected IHDR and IEND once each, IDAT, and no other critical chunk")
    idat = [i for i, t in enumerate(types) if t == b"IDAT"]
    if not idat or idat != list(range(idat[0], idat[-1] + 1)):
        raise Mismatch(f"chunks {types}: the IDAT chunks must be present and consecutive")
    ihdr = found[0][1]
    if len(ihdr) != 13:
        raise Mismatch(f"IHDR has {len(ihdr)} bytes, not 13")
    width, height, depth, colour, compression, filter_method, interlace = struct.unpack(">IIBBBBB", ihdr)
    fields = (depth, colour, compression, filter_method, interlace)
    if width == 0 or height == 0 or fields != (8, 2, 0, 0, 0):
        raise Mismatch(f"IHDR {width}x{height}, bit depth {depth}, colour type {colour}, compression "
                       f"{compression}, filter {filter_method}, interlace {interlace}: expected 8-bit RGB")
    pixels = unfilter(inflate(b"".join(found[i][1] for i in idat), "the IDAT stream"), width, height)
    raw = read(raw_path)
    if pixels != raw:
        difference = first_difference(pixels, raw)
        raise Mismatch(f"the {width}x{height} pixels differ from {raw_path} ({difference})")


def main(argv):
    if len(argv) != 3:
        print("usage: check_png.py PNG_FILE RAW_RGB_FILE")
        return 2
    try:
        check_png(argv[1], argv[2])
    except (Mismatch, OSError) as e:
        print(e)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
