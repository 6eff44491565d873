"""An image-bearing chat prompt, as transformers 5.24's `nemotron_h_omni` processor builds it.

OpenAI-style messages (images as `image_url` parts with `data:image/...;base64,` URLs, or `image` parts with
raw `bytes`) -> the checkpoint's chat template renders each image part as `<image>`; each `<image>` is replaced
in order by `<img>` + `<image>` x (gh*gw/4) + `</img>` (the processor's `replace_image_token`), or in the static
tiled scheme (`nemotron.vision_tiles`) by `<img>` + `<image>` x (tiles * 256) + `</img>` (the Nano 12B v2 VL
processor's `_add_image_placeholders`: one wrapper per image, not per tile); the text is tokenized without
special tokens (the template writes them). The `<image>` positions are where the projector's
output goes (`NemotronH.forward(..., image_embeds=, image_positions=)`).

`encode_prompt` is that render -> expand -> encode -> check, once: `build_image_prompt` (tools, tests) and the
server (`server.app`, with its own template call and errors) both use it.
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from nemotron import vision_preprocess as vp


@dataclass
class ImagePrompt:
    ids: list[int]
    pixel_values: torch.Tensor          # (sum of patches, 3*P*P) fp32
    grid_hw: torch.Tensor               # (n_grids, 2): one per image (dynamic) or per tile (tiled)
    image_positions: torch.Tensor       # (sum of gh*gw/4,) indices of the `<image>` tokens in ids, in order
    grids_per_image: list[int] | None = None    # grids of each image (consecutive in grid_hw); None: one each


class ImageTokenError(ValueError):
    """The prompt's `<image>` tokens do not match its images (e.g. a literal `<image>` in a text part)."""


@dataclass
class PromptImages:
    """A prompt's images, preprocessed: what the expansion of its `<image>`s and the check of its ids need."""
    grid_hw: object                     # (n_grids, 2) rows, a tensor or a list of [gh, gw]
    grids_per_image: list[int] | None   # consecutive grids of each image (tiles); None: one each
    geom: vp.ImageGeometry
    token_id: int                       # the `<image>` id (`image_token_id`)

    def expand(self, text: str) -> str:
        try:
            return expand_image_tokens(text, self.grid_hw, self.geom, self.grids_per_image)
        except ValueError as e:
            raise ImageTokenError(str(e)) from e

    def positions(self, ids: list[int]) -> list[int]:
        """Where the `<image>` tokens are; as many as the images need, else ImageTokenError."""
        positions = [i for i, t in enumerate(ids) if t == self.token_id]
        want = sum(vp.tokens_per_image(self.grid_hw, self.grids_per_image, self.geom))
        if len(positions) != want:
            raise ImageTokenError(f"the prompt has {len(positions)} {vp.IMAGE_TOKEN} tokens where the images need "
                                  f"{want}")
        return positions


@dataclass
class EncodedPrompt:
    ids: list[int]
    image_positions: list[int]          # indices of the `<image>` tokens in ids, in order (empty without images)
    messages_end: int | None = None     # len(ids) where the last message ends, when asked for and a prefix


def encode_prompt(render: Callable[[bool], str], encode: Callable[[str], list[int]],
                  images: PromptImages | None = None, add_generation_prompt: bool = True,
                  messages_end: bool = False,
                  encode_split: Callable[[str, int], tuple[list[int], int | None]] | None = None) -> EncodedPrompt:
    """render(add_generation_prompt) -> the chat template's text; each `<image>` in it becomes its image's
    placeholder; encode(text) -> ids. With `messages_end`, the prompt is rendered a second time without the
    generation prompt: where those ids end, if they are a proper prefix, is where the last message ends (the
    next turn re-renders what follows, so only the text up to there is certain to come back token for token).

    `encode_split(text, n_chars)` -> (ids of text, how many of them text[:n_chars] encodes to, or None where that
    is not proven; server/tokenizer.py `encode_split`): when the text without the generation prompt is a prefix of
    the prompt's, the prompt is tokenized once, not twice (a 16k-token prompt: one encode of ~12-30 ms saved before
    its prefill starts). Where it proves nothing, the second encode decides as before."""
    expand = images.expand if images is not None else (lambda text: text)
    text = expand(render(add_generation_prompt))
    if not (messages_end and add_generation_prompt):
        ids = encode(text)
        return EncodedPrompt(ids, images.positions(ids) if images is not None else [])
    base_text = expand(render(False))
    n = None
    if encode_split is not None and 0 < len(base_text) < len(text) and text.startswith(base_text):
        ids, n = encode_split(text, len(base_text))
    else:
        ids = encode(text)
    out = EncodedPrompt(ids, images.positions(ids) if images is not None else [])
    if n is None:
        base = encode(base_text)
        n = len(base) if ids[:len(base)] == base else None
    if n is not None and 0 < n < len(ids):
        out.messages_end = n
    return out


def image_bytes(part: dict) -> bytes:
    """The encoded image of one content part."""
    if part.get("type") == "image" and isinstance(part.get("image"), (bytes, bytearray)):
        return bytes(part["image"])
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError("an image part needs a data: URL (data:image/png;base64,...)")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"image URL {header[:40]!r}...: only base64 data URLs are supported")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise ValueError(f"image data URL: invalid base64 ({e})") from e


def message_images(messages: list[dict]) -> list[bytes]:
    """Encoded images of all image parts, in message and part order (the order the template renders them)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            out += [image_bytes(p) for p in content if isinstance(p, dict) and p.get("type") in ("image", "image_url")]
    return out


def expand_image_tokens(text: str, grid_hw, geom: vp.ImageGeometry, grids_per_image=None) -> str:
    """Replace the i-th `<image>` of the rendered prompt by image i's placeholder. `grids_per_image`: how many
    consecutive rows of `grid_hw` each image has (its tiles in the tiled scheme); None: one each."""
    pieces = text.split(vp.IMAGE_TOKEN)
    counts = vp.tokens_per_image(grid_hw, grids_per_image, geom)
    if len(pieces) - 1 != len(counts):
        raise ValueError(f"the rendered prompt has {len(pieces) - 1} {vp.IMAGE_TOKEN} for {len(counts)} images")
    out = [pieces[0]]
    for n, rest in zip(counts, pieces[1:]):
        out += [vp.placeholder_for(n), rest]
    return "".join(out)


def image_token_id(model_config: dict) -> int:
    """`<image>` id from an Omni / VL config.json (released or transformers names)."""
    for key in ("image_token_id", "img_context_token_id"):
        if model_config.get(key) is not None:
            return int(model_config[key])
    raise ValueError("config.json names no image_token_id / img_context_token_id")


def build_image_prompt(model_dir, messages: list[dict], model_config: dict, tokenizer=None,
                       add_generation_prompt: bool = True) -> ImagePrompt:
    model_dir = Path(model_dir)
    if tokenizer is None:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    geom_file = model_dir / "preprocessor_config.json"
    geom = vp.ImageGeometry.from_dict(json.loads(geom_file.read_text()) if geom_file.exists() else {},
                                      model_config)
    images = [vp.decode_image(b) for b in message_images(messages)]
    if images:
        pixel_values, grid_hw, per_image = vp.preprocess_images(images, geom)
    else:
        pixel_values, grid_hw = torch.zeros(0, 3 * geom.patch_size ** 2), torch.zeros(0, 2, dtype=torch.int64)
        per_image = []
    tok_id = image_token_id(model_config)
    if tokenizer.convert_tokens_to_ids(vp.IMAGE_TOKEN) != tok_id:
        raise ValueError(f"the tokenizer's {vp.IMAGE_TOKEN} is id {tokenizer.convert_tokens_to_ids(vp.IMAGE_TOKEN)}, "
                         f"config.json says {tok_id}")
    p = encode_prompt(
        lambda gen: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen),
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        PromptImages(grid_hw, per_image, geom, tok_id), add_generation_prompt)
    positions = torch.tensor(p.image_positions, dtype=torch.long)
    return ImagePrompt(p.ids, pixel_values, grid_hw, positions, per_image)
