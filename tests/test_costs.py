"""FLOP estimates (TensorFlow-free)."""

from tfremat.costs import ELEMENT_MOVE_COST as M
from tfremat.costs import einsum_flops, op_cost


def test_matmul_and_transposed_matmul():
    assert op_cost("MatMul", [(64, 512), (512, 256)], [(64, 256)]) == 2 * 64 * 256 * 512
    # x^T @ dy (a weight gradient): contracted dim is the batch.
    assert op_cost("MatMul", [(1024, 128), (1024, 256)], [(128, 256)]) == 2 * 128 * 256 * 1024


def test_conv_counts_kernel_per_output():
    assert op_cost("Conv2D", [(2, 8, 8, 32), (3, 3, 32, 16)], [(2, 8, 8, 16)]) == 2 * (2 * 8 * 8 * 16) * 288


def test_memory_bound_ops_are_charged_for_traffic():
    # A thin matmul moves more than it computes: the traffic term wins.
    assert op_cost("MatMul", [(4, 8), (8, 16)], [(4, 16)]) == M * (32 + 128 + 64)
    # An elementwise op over a big tensor costs far more than its arithmetic, and a
    # BatchNorm-sized elementwise chain is no longer negligible next to a convolution.
    relu = op_cost("Relu", [(64, 32, 32, 32)], [(64, 32, 32, 32)])
    conv = op_cost("Conv2D", [(64, 32, 32, 32), (3, 3, 32, 32)], [(64, 32, 32, 32)])
    assert relu == M * 2 * 64 * 32 * 32 * 32
    assert 0.05 < relu / conv < 0.5
    assert op_cost("Reshape", [(64, 32)], [(2048,)]) == 1  # aliases its input


def test_einsum_products_of_indices():
    assert einsum_flops("abc,cd->abd", [(2, 3, 4), (4, 5)]) == 2 * 2 * 3 * 4 * 5
    big = [(8, 64, 128), (128, 256)]
    assert op_cost("Einsum", big, [(8, 64, 256)], "abc,cd->abd") == 2 * 8 * 64 * 128 * 256
    assert einsum_flops("...c,cd->...d", [(2, 4), (4, 5)]) is None  # ellipsis: fall back
    assert op_cost("Einsum", [(2, 4), (4, 5)], [(2, 5)], "...c,cd->...d") == M * (8 + 20 + 10)


def test_elementwise_cost_and_at_least_one():
    assert op_cost("Relu", [(3, 5)], [(3, 5)]) == M * 30
    assert op_cost("NoOp", [], []) == 1
