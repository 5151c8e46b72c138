import pytest

from shardviz.geometry import mesh


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


def test_find_dim_picks_the_mesh_and_dim_whose_groups_these_are():
    dp_tp = ((2, 2), ("dp", "tp"), (0, 1, 2, 3))
    tp_dp = ((2, 2), ("tp", "dp"), (0, 1, 2, 3))
    # groups [0,1],[2,3] are dim 1 of (dp, tp) and dim 1 of (tp, dp): the first mesh wins...
    assert mesh.find_dim(((0, 1), (2, 3)), [dp_tp, tp_dp]) == (1, "tp")
    assert mesh.find_dim(((0, 1), (2, 3)), [tp_dp, dp_tp]) == (1, "dp")
    # ...unless the group's own name says which
    assert mesh.find_dim(((0, 1), (2, 3)), [tp_dp, dp_tp], "tp") == (1, "tp")
    assert mesh.find_dim(((0, 2), (1, 3)), [dp_tp], "dp") == (0, "dp")
    # a mesh of other ranks, or no match: the name alone, and never a bare dim_<i>
    assert mesh.find_dim(((4, 5),), [dp_tp], "ep") == (None, "ep")
    assert mesh.find_dim(((0, 3), (1, 2)), [dp_tp], "dim_0") == (None, None)
    assert mesh.find_dim(((0, 1, 2, 3),), [((4,), None, (0, 1, 2, 3))]) == (0, None)


def test_group_dim_name_reads_devicemesh_group_names():
    assert mesh.group_dim_name("mesh_tp") == "tp"
    assert mesh.group_dim_name("mesh_default") is None
    assert mesh.group_dim_name("undefined") is None
