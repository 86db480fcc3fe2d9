"""tree.render: the text and plot of one row of a tree name a row that is not there (indexing would clamp to
the last row and show another row's tree under its name)."""

import jax
import pytest

from ddtree_jax.tree import build_tree
from ddtree_jax.tree.render import format_tree


def test_a_row_out_of_range_is_named():
    tree = build_tree(jax.random.normal(jax.random.key(0), (2, 3, 20)), 6)
    assert format_tree(tree, 1) != format_tree(tree, 0)  # two rows, two trees
    assert format_tree(tree, -1) == format_tree(tree, 1)  # from the end, as Python indexes
    for row in (2, 9, -3):
        with pytest.raises(ValueError, match=f"row {row} is out of range for a tree of 2 rows"):
            format_tree(tree, row)
