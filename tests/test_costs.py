"""FLOP estimates (TensorFlow-free)."""

from tfremat.costs import einsum_flops, op_cost


def test_matmul_and_transposed_matmul():
    assert op_cost("MatMul", [(4, 8), (8, 16)], [(4, 16)]) == 2 * 4 * 16 * 8
    # x^T @ dy (a weight gradient): contracted dim is the batch.
    assert op_cost("MatMul", [(32, 8), (32, 16)], [(8, 16)]) == 2 * 8 * 16 * 32


def test_conv_counts_kernel_per_output():
    assert op_cost("Conv2D", [(2, 8, 8, 3), (3, 3, 3, 16)], [(2, 8, 8, 16)]) == 2 * (2 * 8 * 8 * 16) * 27


def test_einsum_products_of_indices():
    assert einsum_flops("abc,cd->abd", [(2, 3, 4), (4, 5)]) == 2 * 2 * 3 * 4 * 5
    assert op_cost("Einsum", [(2, 3, 4), (4, 5)], [(2, 3, 5)], "abc,cd->abd") == 240
    assert einsum_flops("...c,cd->...d", [(2, 4), (4, 5)]) is None  # ellipsis: fall back
    assert op_cost("Einsum", [(2, 4), (4, 5)], [(2, 5)], "...c,cd->...d") == 10


def test_elementwise_is_output_elements_and_at_least_one():
    assert op_cost("Relu", [(3, 5)], [(3, 5)]) == 15
    assert op_cost("NoOp", [], []) == 1
