"""kernels.rows.spread_rows (rows into a filled tensor in one pass) against its torch reference,
bit for bit, on the CPU under TRITON_INTERPRET=1 (in a child process: the variable must be set
before triton is imported); and ops.scatter_rows / gather_rows, which route to it on a GPU."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from conftest import assert_interpreted_case, run_interpreted
from eagle3.ops import gather_rows, scatter_rows

# (rows of the source, rows of the output, row shape, dtype, fill): a width that is not a multiple
# of the block (64 columns interpreted), several blocks per row, heads x dim rows, no source rows,
# every row a source row, a nonzero fill
CASES = [(5, 11, (3, 7), "float32", 0), (9, 9, (130,), "bfloat16", 0), (0, 4, (2, 8), "bfloat16", 0),
         (6, 20, (4, 16), "float32", -1.5), (1, 1, (1,), "float32", 0)]


INTERPRETED_CHILD = True   # conftest starts the child at collection, in the background


@pytest.fixture(scope="module")
def results():
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_triton_spread_is_the_reference_bit_for_bit(results, case):
    assert_interpreted_case(results, case, CASES[case])


def test_scatter_and_gather_rows_are_each_others_gradient():
    """scatter_rows' gradient is the gather of the rows it wrote; gather_rows' is the spread of the
    rows it read (zeros elsewhere): both as the indexing autograd gives them."""
    g = torch.Generator().manual_seed(2)
    index = torch.tensor([1, 4, 5, 8])
    t = torch.randn(4, 3, 2, generator=g, requires_grad=True)
    x = torch.randn(10, 3, 2, generator=g, requires_grad=True)
    dy_full, dy_rows = torch.randn(10, 3, 2, generator=g), torch.randn(4, 3, 2, generator=g)
    spread = scatter_rows(t, index, 10)
    assert torch.equal(spread[index], t) and spread[[0, 2, 3, 6, 7, 9]].abs().sum() == 0
    assert torch.equal(torch.autograd.grad(spread, t, dy_full)[0], dy_full[index])
    rows = gather_rows(x, index)
    expect = torch.zeros(10, 3, 2).index_put((index,), dy_rows)
    assert torch.equal(rows, x[index]) and torch.equal(torch.autograd.grad(rows, x, dy_rows)[0], expect)
    assert gather_rows(x, None) is x and scatter_rows(t, None, 10) is t


def _child() -> None:
    assert "triton" not in sys.modules
    from triton.runtime.interpreter import InterpretedFunction

    from eagle3.kernels import reference, rows

    print(json.dumps({"case": "interpreted", "ok": isinstance(rows._spread_kernel, InterpretedFunction)}))
    g = torch.Generator().manual_seed(0)
    for i, (n, total, shape, dtype, fill) in enumerate(CASES):
        src = torch.randn(n, *shape, generator=g).to(getattr(torch, dtype))
        index = torch.randperm(total, generator=g)[:n].sort().values
        got, want = rows.spread_rows(src, index, total, fill), reference.spread_rows(src, index, total, fill)
        ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        print(json.dumps({"case": str(i), "ok": bool(ok), "detail": f"{tuple(got.shape)} vs {tuple(want.shape)}"}),
              flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")   # run as a script by hand too
    _child()
