"""The hot path's cheaper idioms (pyro_ngvi.hot_path): a step's Python numbers as 0-d tensors give
the same values as the Python number, to the bit, without the cast; no_grad is torch.no_grad."""

import pytest
import torch

from pyro_ngvi import hot_path
from pyro_ngvi.hot_path import scalar


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_operation_with_the_kept_number_is_the_operation_with_the_python_number(dtype):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=dtype) * 10
    for number in (1257 / 128, 4096 / 128 / 3, 0.1, 1 / 3, 7.3e-5, 1.0, 7510.0):
        kept = scalar(number, x)
        assert kept.dtype == dtype and kept.dim() == 0
        assert torch.equal(x * kept, x * number) and torch.equal(x / kept, x / number)
        assert torch.equal(kept - x, number - x)
        ys, zs = [x.clone(), x[:10].clone()], [x.clone(), x[:10].clone()]
        torch._foreach_mul_(ys, kept)
        torch._foreach_mul_(zs, number)
        assert all(torch.equal(y, z) for y, z in zip(ys, zs))


def test_numbers_are_made_once_and_the_table_is_bounded():
    x = torch.zeros(3)
    assert scalar(0.25, x) is scalar(0.25, x)
    assert scalar(0.25, x) is not scalar(0.25, x.double())
    for k in range(2 * hot_path.KEPT):
        scalar(float(k), x)
    assert len(hot_path._kept) <= hot_path.KEPT


def test_no_grad_turns_gradients_off_and_restores_the_mode():
    seen = []

    @hot_path.no_grad
    def inside(fail=False):
        seen.append(torch.is_grad_enabled())
        if fail:
            raise ValueError("inside")
        return torch.ones(2, requires_grad=True) * 2

    assert not inside().requires_grad and torch.is_grad_enabled()
    with pytest.raises(ValueError):
        inside(fail=True)
    assert torch.is_grad_enabled()
    with torch.no_grad():
        inside()
        assert not torch.is_grad_enabled()
    assert seen == [False, False, False] and inside.__name__ == "inside"
