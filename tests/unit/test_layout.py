"""The pure geometry against expectations written out by hand."""

import pytest

import shardviz as sv
from shardviz.geometry.layout import Layout


def shapes(layout):
    return [s.shape for s in layout.shards]


def test_uneven_rows_like_torch_chunk():
    lay = sv.layout((10, 3), (4,), ["S(0)"])
    assert shapes(lay) == [(3, 3), (3, 3), (3, 3), (1, 3)]
    assert [s.offset for s in lay.shards] == [(0, 0), (3, 0), (6, 0), (9, 0)]
    assert lay.shard(3).indices == ((range(9, 10),), (range(0, 3),))


def test_2d_mesh_matches_cluster_measurement():
    # Measured on real gloo ranks (notes/cluster.md): (3,4)(3,3)(2,4)(2,3).
    lay = sv.layout((5, 7), (2, 2), ["S(0)", "S(1)"], ("dp", "tp"))
    assert shapes(lay) == [(3, 4), (3, 3), (2, 4), (2, 3)]
    assert [s.coord for s in lay.shards] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert lay.mesh_dim_names == ("dp", "tp")


def test_empty_shards_when_dim_smaller_than_mesh():
    lay = sv.layout((2, 5), (4,), ["S(0)"])
    assert shapes(lay) == [(1, 5), (1, 5), (0, 5), (0, 5)]
    assert lay.shard(2).empty and not lay.shard(1).empty
    assert lay.shard(2).indices[0] == ()


def test_chunk_semantics_leave_trailing_empty():
    # torch.chunk(5 rows, 4) gives sizes 2, 2, 1 and DTensor fills the 4th with an empty shard.
    assert [s.shape[0] for s in sv.layout((5,), (4,), ["S(0)"]).shards] == [2, 2, 1, 0]


def test_same_dim_sharded_twice_nests_left_to_right():
    lay = sv.layout((8,), (2, 2), ["S(0)", "S(0)"])
    assert [s.indices[0] for s in lay.shards] == [
        (range(0, 2),),
        (range(2, 4),),
        (range(4, 6),),
        (range(6, 8),),
    ]


def test_strided_shard_matches_torch_docstring_table():
    # torch's _StridedShard docstring: ranks 0..3 hold rows 0-1, 4-5, 2-3, 6-7.
    lay = sv.layout((8, 8), (2, 2), ["_S(0,sf=2)", "S(0)"], ("dp", "tp"))
    assert [s.indices[0] for s in lay.shards] == [
        (range(0, 2),),
        (range(4, 6),),
        (range(2, 4),),
        (range(6, 8),),
    ]


def test_strided_shard_is_not_contiguous():
    lay = sv.layout((8,), (2,), ["_S(0,sf=2)"])
    # First split into 2 pieces [0..4) [4..8), then each into 2: rank 0 takes 0-1 and 4-5.
    assert lay.shard(0).indices == ((range(0, 2), range(4, 6)),)
    assert lay.shard(1).indices == ((range(2, 4), range(6, 8)),)
    assert not lay.shard(0).contiguous
    assert lay.shard(0).shape == (4,)


def test_replicate_and_partial():
    lay = sv.layout((4, 2), (2, 2), ["R", "P"])
    assert all(s.shape == (4, 2) and s.partial for s in lay.shards)
    assert lay.placements == ("R", "P(sum)")
    assert not any(s.partial for s in sv.layout((4,), (2,), ["R"]).shards)


def test_scalar_and_high_rank_tensors():
    assert shapes(sv.layout((), (2,), ["R"])) == [(), ()]
    lay = sv.layout((2, 3, 4, 5, 6), (2, 3), ["S(4)", "S(1)"])
    assert lay.shard(5).shape == (2, 1, 4, 5, 3)


def test_owners():
    lay = sv.layout((4, 4), (2, 2), ["S(0)", "R"])
    assert lay.owners((0, 0)) == [0, 1]
    assert lay.owners((3, 1)) == [2, 3]


def test_mesh_ranks():
    lay = sv.layout((4,), (2,), ["S(0)"], mesh_ranks=[6, 7])
    assert lay.ranks == (6, 7)
    assert lay.shard(7).offset == (2,)


def test_512_ranks():
    lay = sv.layout((8192, 28672), (8, 8, 8), ["S(0)", "S(1)", "R"], ("pp", "dp", "tp"))
    assert lay.world_size == 512
    assert lay.shard(511).offset == (7168, 25088)
    assert all(s.shape == (1024, 3584) for s in lay.shards)


def test_text_table_is_exact():
    # 5 rows: S(0) gives [0,1,2] | [3,4]; _S(sf=2) splits [0,1,2] into [0,1],[2] then halves
    # each: rank 0 keeps rows 0 and 2, rank 1 row 1; [3,4] -> [3],[4]: rank 2 keeps both.
    text = str(sv.layout((5, 3), (2, 2), ["S(0)", "_S(0,sf=2)"], ("dp", "tp")))
    assert text == "\n".join(
        [
            "Layout (5, 3) float32 on mesh (2, 2) ('dp', 'tp') placements [S(0), _S(0,sf=2)]",
            "rank  coord   offset  shape   indices",
            "   0  (0, 0)  (0, 0)  (2, 3)  [0:1,2:3, 0:3]  strided",
            "   1  (0, 1)  (1, 0)  (1, 3)  [1:2, 0:3]",
            "   2  (1, 0)  (3, 0)  (2, 3)  [3:5, 0:3]",
            "   3  (1, 1)  -       (0, 3)  [-, 0:3]        empty",
        ]
    )


def test_round_trip_dict():
    lay = sv.layout((7, 5), (2, 3), ["_S(0,sf=2)", "S(1)"], ("a", "b"))
    assert Layout.from_dict(lay.to_dict()) == lay


@pytest.mark.parametrize(
    "args, error, match",
    [
        (((4,), (2,), ["Q"]), ValueError, "unknown placement"),
        (((4,), (2,), ["S(1)"]), ValueError, "shards dim 1, but the tensor has 1"),
        (((4,), (2, 2), ["S(0)"]), ValueError, "one placement per mesh dimension"),
        (((4,), (0,), ["S(0)"]), ValueError, "positive int"),
        (((-1,), (2,), ["R"]), ValueError, "non-negative"),
        (((4,), (2,), ["R"], ("a", "b")), ValueError, "one per mesh dim"),
        (((4,), (2, 2), ["R", "R"], ("a", "a")), ValueError, "repeat a name"),
        (("abc", (2,), ["R"]), ValueError, "non-negative int"),
        (((4,), None, ["R"]), TypeError, "needs all three"),
    ],
)
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        sv.layout(*args)


def test_plain_tensor_is_refused_with_guidance():
    import torch

    with pytest.raises(TypeError, match="has no placements"):
        sv.layout(torch.ones(3))


# ---- explicit shard sizes (tensors that choose their own, e.g. PhysicsNeMo's ShardTensor) -------


def test_shard_sizes_replace_chunking_on_their_mesh_dim():
    lay = sv.layout((10,), (4,), ["S(0)"], shard_sizes={0: (3, 3, 2, 2)})
    # by hand: 3, 3, 2, 2 from the start of the vector (chunking would give 3, 3, 3, 1)
    assert [s.shape for s in lay] == [(3,), (3,), (2,), (2,)]
    assert [s.offset for s in lay] == [(0,), (3,), (6,), (8,)]
    assert [s.indices for s in lay] == [((range(a, b),),) for a, b in ((0, 3), (3, 6), (6, 8), (8, 10))]
    assert lay.owners((7,)) == [2]


def test_shard_sizes_on_a_2d_mesh_and_an_empty_shard():
    lay = sv.layout((5, 6), (2, 2), ["S(0)", "S(1)"], shard_sizes={1: (6, 0)})
    # mesh dim 0 chunks the 5 rows (3, 2); mesh dim 1 gives all 6 columns to coordinate 0
    assert [s.shape for s in lay] == [(3, 6), (3, 0), (2, 6), (2, 0)]
    assert lay.shard(1).empty and not lay.shard(0).empty
    assert lay.shard(2).indices == ((range(3, 5),), (range(0, 6),))


def test_shard_sizes_nest_inside_an_earlier_split_of_the_same_dim():
    lay = sv.layout((10, 2), (2, 2), ["S(0)", "S(0)"], shard_sizes={0: (4, 6)})
    # rows 0-3 to coordinate 0 of mesh dim 0 and rows 4-9 to 1, then each piece chunked in two
    assert [s.offset[0] for s in lay] == [0, 2, 4, 7] and [s.shape[0] for s in lay] == [2, 2, 3, 3]
    # sizes for the inner mesh dim must fit every piece it cuts: rows 4-9 (6) are not 2 + 2
    with pytest.raises(
        ValueError, match=r"add up to 4, but the piece mesh dim 1 splits at coordinate \(1, 0\) has 6"
    ):
        sv.layout((10, 2), (2, 2), ["S(0)", "S(0)"], shard_sizes={0: (4, 6), 1: (2, 2)})


@pytest.mark.parametrize(
    "sizes, error, match",
    [
        ({0: (3, 3, 2, 1)}, ValueError, "add up to 9"),
        ({0: (5, 5)}, ValueError, "give 4 non-negative int"),
        ({0: (3, 3, -1, 5)}, ValueError, "give 4 non-negative int"),
        ({1: (3, 3, 2, 2)}, ValueError, "mesh dim 1"),
        ({0: 7}, TypeError, "list of ints"),
    ],
)
def test_bad_shard_sizes_say_what_is_wrong(sizes, error, match):
    with pytest.raises(error, match=match):
        sv.layout((10,), (4,), ["S(0)"], shard_sizes=sizes)


def test_shard_sizes_only_for_a_plain_shard():
    with pytest.raises(ValueError, match=r'apply to a "S\(d\)" placement only'):
        sv.layout((10,), (2,), ["R"], shard_sizes={0: (5, 5)})
    with pytest.raises(ValueError, match="placement is _S"):
        sv.layout((10,), (2,), ["_S(0,sf=2)"], shard_sizes={0: (5, 5)})


def test_explicit_layouts_round_trip_and_are_not_chunked_ones():
    lay = sv.layout((10,), (4,), ["S(0)"], shard_sizes={0: (3, 3, 2, 2)})
    assert Layout.from_dict(lay.to_dict()) == lay
    assert lay != sv.layout((10,), (4,), ["S(0)"])
