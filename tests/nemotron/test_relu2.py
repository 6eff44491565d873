"""relu2_ (the prefill's shared expert, in place on the up projection's output) against relu2."""
import torch

from nemotron.moe import relu2, relu2_


def test_relu2_in_place_equals_relu2_and_writes_its_input():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(37, 131, generator=g, dtype=torch.float32)
    want = relu2(x)
    assert (x < 0).any() and (want == 0).any() and (want > 1).any()     # both branches of the ReLU taken
    y = x.clone()
    got = relu2_(y)
    assert got.data_ptr() == y.data_ptr()           # no second tensor
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # twin: the same check catches an in-place square that drops the ReLU (the negative inputs squared)
    assert not torch.allclose(x.clone().square_(), want)
