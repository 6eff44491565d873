"""`greedy_logits` row i holds the logits greedy token i was chosen from, in tools.logits and in the
transformers reference alike: argmax(row i) == greedy[i], row 0 is the prefill's last row."""
from __future__ import annotations

import numpy as np

from nemotron.model import NemotronH
from tools.hf_reference import dequantize_checkpoint, hf_logits_and_greedy, load_hf_model
from tools.logits import logits_and_greedy

N = 6


def rows_choose_their_tokens(logits, greedy, gl) -> bool:
    return (len(gl) == len(greedy) and np.array_equal(gl.argmax(-1), greedy)
            and np.array_equal(gl[0], logits[-1]))


def one_step_late(model, ids, greedy):
    """The old contract (the must-fail twin): row i = the logits after feeding greedy token i."""
    st = model.new_state()
    model.forward(ids, st)
    return np.stack([model.forward([int(t)], st)[0].numpy() for t in greedy])


def test_engine_and_reference_rows_are_the_logits_behind_each_token(synth, tmp_path):
    model_dir = synth("tiny", "nvfp4")
    ids = [int(t) for t in np.random.default_rng(2).integers(14, 1000, size=11)]
    engine = NemotronH(model_dir)
    logits, greedy, gl = logits_and_greedy(engine, ids, N)
    assert rows_choose_their_tokens(logits, greedy, gl)
    hf = load_hf_model(dequantize_checkpoint(model_dir, tmp_path / "dense"))
    r_logits, r_greedy, r_gl = hf_logits_and_greedy(hf, ids, N)
    assert rows_choose_their_tokens(r_logits, r_greedy, r_gl)
    np.testing.assert_array_equal(greedy, r_greedy)
    np.testing.assert_allclose(gl, r_gl, rtol=1e-4, atol=1e-4)     # the same rows, not shifted by one
    late = one_step_late(engine, ids, greedy)
    assert not rows_choose_their_tokens(logits, greedy, late), "the check cannot tell the one-step-late rows"
    assert np.abs(late - r_gl).max() > 1e-2
