"""A dependency-free line chart written as a PNG (for the demo's loss curves)."""
from __future__ import annotations

import math
import struct
import zlib

WHITE, GREY, BLACK = (255, 255, 255), (200, 200, 200), (0, 0, 0)


def _png(width: int, height: int, pixels: bytearray) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + bytes(pixels[y * width * 3:(y + 1) * width * 3]) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def line_chart(series: dict, path: str, width: int = 640, height: int = 400, log_y: bool = True) -> None:
    """series: name -> ((r, g, b), [y values, one per x step]). Draws axes and one polyline per series."""
    pixels = bytearray(WHITE * (width * height))
    margin = 40
    values = [v for _, ys in series.values() for v in ys if math.isfinite(v) and (v > 0 or not log_y)]
    transform = math.log10 if log_y else (lambda v: v)
    lo, hi = (transform(min(values)), transform(max(values))) if values else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    steps = max(len(ys) for _, ys in series.values())

    def put(x, y, color):
        if 0 <= x < width and 0 <= y < height:
            pixels[(y * width + x) * 3:(y * width + x) * 3 + 3] = bytes(color)

    def line(x0, y0, x1, y1, color):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(n + 1):
            put(round(x0 + (x1 - x0) * i / n), round(y0 + (y1 - y0) * i / n), color)

    line(margin, height - margin, width - margin, height - margin, BLACK)  # x axis
    line(margin, margin, margin, height - margin, BLACK)  # y axis
    for tick in range(1, 5):
        y = margin + (height - 2 * margin) * tick // 5
        line(margin + 1, y, width - margin, y, GREY)
    for color, ys in series.values():
        points = []
        for i, v in enumerate(ys):
            if not math.isfinite(v) or (log_y and v <= 0):
                continue
            x = margin + round((width - 2 * margin) * i / max(steps - 1, 1))
            y = height - margin - round((height - 2 * margin) * (transform(v) - lo) / (hi - lo))
            points.append((x, y))
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            line(x0, y0, x1, y1, color)
    with open(path, "wb") as f:
        f.write(_png(width, height, pixels))
