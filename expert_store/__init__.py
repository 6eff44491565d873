"""The expert store: one file of O_DIRECT-ready expert blocks, a manifest, and the dense weights.

A library (it imports no process package). The modules, lowest first:

- `kernels.expert_block.ExpertGeometry` — the block's geometry, the one type passed end to end (store,
  cache, kernels). It lives in `kernels`, the lowest library, because the kernels read blocks through it.
- `format` — file names, format version, the errors, durable writes, the manifest's reader and writer.
- `layout` — block bytes <-> checkpoint tensors (packer, unpacker, views of a block in any buffer).
- `reader` — `ExpertStore.open`: an opened, checked store.
- `source` — the checkpoint being repacked, read by its safetensors headers, and the `Plan` checked from it.
- `journal`, `writer` — `repack`, resumable after a kill.
- `verify` — every block decoded back and compared with the checkpoint bit for bit (`progress`: their byte bar).

`format`, `layout` and `reader` import numpy only (torch when a block is unpacked or viewed), so a
process without torch can open a store. `docs/store-format.md` and `docs/block-layout.md` are the contract;
`python -m tools.repack` is the command line.
"""
