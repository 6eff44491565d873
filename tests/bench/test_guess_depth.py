"""bench.guess_depth on the trained instrument-tiny: the next layer's router, applied to this layer's input, guesses
far better than chance (what the prefetch and the early ups rely on), and the hit-by-rank helper counts right."""
import json

import torch

from bench import guess_depth


def test_hit_by_rank_counts_membership_not_position():
    guess = torch.tensor([[1, 2, 3], [4, 5, 6]])
    actual = torch.tensor([[3, 1, 9], [7, 8, 4]])
    assert guess_depth.hit_by_rank(guess, actual).tolist() == [1.0, 0.0, 0.5]


def test_trained_routers_guess_ahead_better_than_chance(tmp_path):
    out = tmp_path / "gd.json"
    guess_depth.main(["--tokens", "200", "--out", str(out)])
    res = json.loads(out.read_text())
    chance = res["k"] / res["experts"]
    d1 = [r["mean"] for r in res["rows"] if r["depth"] == 1]
    assert d1 and min(d1) > 3 * chance
    # a shuffled-token twin: the same routers guessing the choice of other tokens fall to about chance
    model = guess_depth.NemotronH(res["model"], device="cpu", dtype=torch.float32)
    from nemotron.moe import MoEMixer
    moes = [m for m in model.mixers if isinstance(m, MoEMixer)]
    ids = list(range(100, 300))
    with torch.inference_mode():
        hs = guess_depth.record_inputs(model, ids)
        g = moes[1].router(hs[0])[0]
        actual = moes[1].router(hs[1])[0]
        perm = torch.randperm(g.shape[0], generator=torch.Generator().manual_seed(0))
        assert float(guess_depth.hit_by_rank(g[perm], actual).mean()) < 2 * chance


def test_first_layer_guesses_are_per_token_and_a_table_reproduces_the_embedding_guess():
    """The first MoE layer's guesses cover tokens 1..T-1; the embedding's is a function of the token id alone, so a
    table over the vocabulary gives it (the twin: the previous token's last-layer guess is not such a function)."""
    from nemotron.moe import MoEMixer
    from nemotron.norms import rms_norm
    model = guess_depth.NemotronH("tests/data/instrument-tiny", device="cpu", dtype=torch.float32)
    moes = [m for m in model.mixers if isinstance(m, MoEMixer)]
    ids = [5, 17, 5, 900, 17, 5, 33]
    with torch.inference_mode():
        hs = guess_depth.record_inputs(model, ids)
        got = guess_depth.first_layer_guesses(model, moes, hs, ids)
        i0 = model.mixers.index(moes[0])
        vocab = torch.arange(1000)
        table = moes[0].router(rms_norm(model.embeddings[vocab].float(), model.norms[i0].float(),
                                        model.config.layer_norm_epsilon))[0]
    emb, today = got["the token's embedding, normed (a table)"], got["previous token's last MoE layer input (today)"]
    assert emb.shape == today.shape == (len(ids) - 1, moes[0].router(hs[0])[0].shape[1])
    assert torch.equal(emb, table[torch.tensor(ids[1:])])
    # rows 1 and 4 are both id 5, rows 0 and 3 both id 17, each after different text: the table gives each id one
    # guess, the last layer's input (the context) does not
    assert torch.equal(emb[1], emb[4])
    assert not all(torch.equal(today[a], today[b]) for a, b in ((1, 4), (0, 3)))
