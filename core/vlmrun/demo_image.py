"""The demo's picture: drawn with Pillow (no data can be downloaded), deterministic."""

from __future__ import annotations

#: What the default model answers to the demo's question ("Describe the image.") about `demo_image`.
DEMO_ANSWER = "A red circle on a blue background."


def demo_image(size: int = 640):
    """A red circle on a blue (vertical gradient) background, ``size`` x ``size * 3 / 4`` pixels (not square, to
    exercise padding), as a PIL RGB image: one of the pictures the default model was trained on
    (`vlmrun.shapes.DEMO_SCENE`)."""
    import attrs

    from .shapes import DEMO_SCENE

    return attrs.evolve(DEMO_SCENE, width=size, height=size * 3 // 4).render()
