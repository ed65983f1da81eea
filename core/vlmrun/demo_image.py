"""The demo's picture: drawn with Pillow (no data can be downloaded), deterministic."""

from __future__ import annotations


def demo_image(size: int = 640):
    """A small scene: sky, sun, a house and grass, as a PIL RGB image (not square, to exercise padding)."""
    from PIL import Image, ImageDraw

    w, h = size, size * 3 // 4
    im = Image.new("RGB", (w, h), (135, 190, 235))
    d = ImageDraw.Draw(im)
    d.rectangle([0, h * 2 // 3, w, h], fill=(60, 150, 60))
    d.ellipse([w * 3 // 4, h // 10, w * 3 // 4 + w // 8, h // 10 + w // 8], fill=(250, 220, 60))
    d.rectangle([w // 5, h // 3, w // 2, h * 2 // 3 + 10], fill=(180, 80, 60))
    d.polygon([(w // 5 - 20, h // 3), (w * 7 // 20, h // 8), (w // 2 + 20, h // 3)], fill=(120, 40, 30))
    d.rectangle([w * 3 // 10, h // 2, w * 2 // 5, h * 2 // 3 + 10], fill=(90, 50, 20))
    return im
