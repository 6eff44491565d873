"""`encode_prompt`, the one render -> expand -> encode -> check of an image prompt (server and tools use it)."""
from __future__ import annotations

import pytest

from nemotron import vision_preprocess as vp
from nemotron.vision_prompt import ImageTokenError, PromptImages, encode_prompt

GEOM = vp.ImageGeometry()          # merge 2: a (4, 6) grid is 6 tokens
IMG = 99


def encode(text: str) -> list[int]:
    """A toy tokenizer: `<image>` is IMG, `<img>`/`</img>` 1 and 2, any other character its code."""
    for tok, tid in ((vp.IMAGE_TOKEN, IMG), (vp.IMAGE_START, 1), (vp.IMAGE_END, 2)):
        text = text.replace(tok, chr(0xE000 + tid))
    return [ord(ch) - 0xE000 if ord(ch) >= 0xE000 else ord(ch) for ch in text]


def render(user: str):
    return lambda gen: f"U:{user};" + ("A:" if gen else "")


def test_images_expand_and_positions_are_checked():
    images = PromptImages([[4, 6]], None, GEOM, IMG)
    p = encode_prompt(render(f"see {vp.IMAGE_TOKEN}"), encode, images, messages_end=True)
    assert p.image_positions == list(range(7, 13))          # "U:see " (6), <img>, then 6 x <image>
    assert [p.ids[i] for i in p.image_positions] == [IMG] * 6
    assert p.messages_end == len(p.ids) - 2                  # before the generation prompt "A:"
    with pytest.raises(ImageTokenError, match="has 2 <image> for 1 images"):        # the twin: a literal <image>
        encode_prompt(render(f"{vp.IMAGE_TOKEN} and {vp.IMAGE_TOKEN}"), encode, images)


def test_a_stray_image_token_after_expansion_is_caught():
    """The count check sees what the expansion cannot: an `<image>` id the tokenizer makes of other text."""
    images = PromptImages([[4, 6]], None, GEOM, IMG)
    with pytest.raises(ImageTokenError, match="has 7 <image> tokens where the images need 6"):
        encode_prompt(render(f"{vp.IMAGE_TOKEN}{chr(IMG)}"), encode, images)


def test_without_images_or_generation_prompt():
    p = encode_prompt(render("hi"), encode, None, add_generation_prompt=False, messages_end=True)
    assert p.ids == encode("U:hi;") and p.image_positions == [] and p.messages_end is None
