"""Writes tests/nemotron/data/vision_preprocess_golden.safetensors from transformers 5.24's NemotronH Omni
image processor.

transformers' processor needs torchvision, and the only torchvision wheel for torch 2.13 here is a CUDA build
whose C ops cannot load on the CPU torch; installed next to torch it breaks every transformers model import
(torchvision's `_meta_registrations` registers fakes for ops that never loaded). So it is kept out of the
environment: install it aside (`pip install --no-deps --target DIR torchvision==0.28.0`) and run
`python tests/nemotron/make_vision_goldens.py DIR`. Only the op schemas are defined here so torchvision's
pure-Python resize (the code transformers calls) can be imported; no torchvision math is replaced.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.nemotron.test_vision_preprocess import GOLDEN, GOLDEN_CASES, N_SAMPLES, make_image, summarize  # noqa: E402


def main(torchvision_dir: str):
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    sys.path.insert(0, torchvision_dir)
    from transformers import NemotronH_Omni_Reasoning_V3ImageProcessor

    out = {}
    for name, (sizes, mode, kwargs) in GOLDEN_CASES.items():
        proc = NemotronH_Omni_Reasoning_V3ImageProcessor(**kwargs)
        images = [make_image(w, h, mode, seed=i) for i, (w, h) in enumerate(sizes)]
        res = proc(images=images, return_tensors="pt")
        pv, grid = res["pixel_values"], res["image_grid_hw"]
        out[f"{name}/grid"] = grid.numpy()
        for k, v in summarize(pv).items():
            out[f"{name}/{k}"] = v
        print(name, tuple(pv.shape), grid.tolist())
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}, GOLDEN)
    print("wrote", GOLDEN, "samples per case", N_SAMPLES)


if __name__ == "__main__":
    main(sys.argv[1])
