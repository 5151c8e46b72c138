import pytest

from shardviz import mesh


def test_dim_groups_2d():
    assert mesh.dim_groups((4, 2), 1) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.dim_groups((4, 2), 0) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_dim_groups_3d():
    assert mesh.dim_groups((2, 3, 4), 1)[:2] == [[0, 4, 8], [1, 5, 9]]
    assert len(mesh.dim_groups((2, 3, 4), 1)) == 8


def test_dim_groups_with_rank_list():
    assert mesh.dim_groups((2, 2), 0, ranks=[4, 5, 6, 7]) == [[4, 6], [5, 7]]


def test_match_dim():
    assert mesh.match_dim([[2, 3], [0, 1]], (2, 2)) == 1
    assert mesh.match_dim([[0, 1, 2, 3]], (2, 2)) is None


@pytest.mark.parametrize("bad", [(), (0,), (2, -1), ("a",), (True,)])
def test_bad_mesh_shape(bad):
    with pytest.raises(ValueError):
        mesh.check_mesh_shape(bad)
